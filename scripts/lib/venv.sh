# Sourced by the ensure-*-env.sh scripts that build a test environment: the one way each decides whether to build.
# Expects VENV, STAMP and PYTHON set.

# open_venv NAME WANT: ends the calling script where $STAMP already holds WANT (the hash of what the environment is
# built from). Otherwise takes $VENV/.build.lock (two test runs in one checkout must not build the same environment
# at once; the lock lives inside the ignored folder), checks again under it, and leaves $VENV with the venv made, pip
# upgraded and no stamp: the caller installs, then writes WANT to $STAMP.
open_venv() {
    local name=$1 want=$2
    if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]]; then
        echo "$name: $VENV is up to date"
        exit 0
    fi
    mkdir -p "$VENV"
    exec 9>"$VENV/.build.lock"
    flock 9
    if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]]; then
        exit 0
    fi
    rm -f "$STAMP"
    [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
}
