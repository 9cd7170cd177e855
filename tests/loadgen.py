"""Load for real-engine tests: clients sending completions back to back until stopped.

A burst of tiny-model completions finishes in well under a second on these cores, shorter than a scrape interval,
so tests that must *see* requests running keep the engine busy for a set time instead. The clients run in a Python
process of their own: as threads of the test process they shared its GIL with the test's own reads and timing
(8 such threads kept only 0-3 sequences in a CPU engine at most instants).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.openai_server import COMPLETIONS_PATH, OpenAIServer

STOP_TIMEOUT_S = 180  # the requests in flight end first: at most max_tokens steps of a loaded CPU engine

# The clients' process: argv url, model, prompt, clients, tokens, tokens_step; runs until its stdin closes, then
# prints {"completed": n, "errors": [...]}. Client i asks for tokens + i * tokens_step tokens (ignoring EOS), so that
# clients' requests end at different steps.
_CLIENTS_SCRIPT = """
import json, sys, threading, urllib.request
url, model, prompt, clients, tokens, step = *sys.argv[1:4], *map(int, sys.argv[4:7])
done, errors, stop = [0], [], threading.Event()
def client(i):
    n = 0
    while not stop.is_set():
        body = {"model": model, "prompt": f"{prompt} {i} {n}", "max_tokens": tokens + i * step,
                "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=120).read()
            done[0] += 1
        except Exception as exc:
            errors.append(repr(exc))
            return
        n += 1
threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
for t in threads: t.start()
sys.stdin.read()
stop.set()
for t in threads: t.join()
print(json.dumps({"completed": done[0], "errors": errors}))
"""


class CompletionClients:
    """`clients` clients, each sending one completion after another to `server` until the block ends (its requests
    then in flight finish first); `completed` and `errors` are read after it."""

    def __init__(
        self,
        server: OpenAIServer,
        model: str,
        clients: int,
        tokens: int,
        tokens_step: int = 0,
        prompt: str = "The quick brown fox",
    ) -> None:
        counts = (str(clients), str(tokens), str(tokens_step))
        self.argv = [sys.executable, "-c", _CLIENTS_SCRIPT, server.url(COMPLETIONS_PATH), model, prompt, *counts]
        self.completed = 0
        self.errors: list[str] = []
        self._process: subprocess.Popen[str] | None = None

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> CompletionClients:
        # A session of its own, like the engine's: where the kernel shares CPU time between sessions (autogroup, on
        # here) the clients no longer take theirs from the test's scraper and its sidecar, which share one session.
        self._process = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        return self

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        assert self._process is not None
        try:
            if error is None:
                out = self._process.communicate("", timeout=STOP_TIMEOUT_S)[0]
                code = self._process.returncode
                assert code == 0 and out, f"the clients' process ended with {code}, printing {out[-300:]!r}"
                outcome = json.loads(out)
                self.completed, self.errors = outcome["completed"], outcome["errors"]
        finally:
            if self._process.poll() is None:
                self._process.kill()
                self._process.communicate()
