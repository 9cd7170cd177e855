"""What the tests and the benchmarks share (support code, not tests: nothing here is collected by pytest).

- `constants`: repository paths, sizes, the simulated GPU, the namespaces the tests use (standard library only: the
  benchmarks' sidecar process imports it);
- `net`: free ports, one HTTP request on a fresh connection, basic-auth headers;
- `pages`: the recorded real engine pages (tests/fixtures) and the vLLM page with another running count;
- `manifests`: manifests built through the real types, and what the sidecar should make of them;
- `scrape`: a scraped page parsed into samples, and the look-ups the tests make on them;
- `exporter`: the exporter in this process, on a real socket;
- `sidecar`: the real sidecar process (`python -m kv_exporter serve ...`), stopped by its pid;
- `engine_process`: simulated engines (kv_exporter.sidecar.simulated_engine) in a process of their own;
- `fake_nvml`: a stand-in NVML binding raising pynvml's real error classes;
- `pki`: a throwaway certificate authority for the TLS tests.
"""
