"""Three real models from one `tokenmill serve` (SmolLM2's and Gemma 3's GGUFs, a tiny random Qwen3 folder), against
each served alone: the same tokens at temperature 0 in fp32, interleaved; then under a budget that holds two, the
loads and unloads a third model causes, with their times and the server's resident memory (docs: many models).

    python scripts/many_models.py [--budget-gib 0.86]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import hf_configs, save_random_hf_model  # noqa: E402

from tokenmill.loader.sources import pull  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
FLAGS = ["--dtype", "float32", "--threads", "2", "--kv-cache-memory", "256MiB",
         "--responses-store", "off", "--log-level", "info", "--port", "0"]


class Server:
    def __init__(self, *args: str) -> None:
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", *args, *FLAGS],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline, self.url = time.time() + 300, ""
        while time.time() < deadline and self.proc.poll() is None:
            found = re.search(r"serving .* on (http://\S+/v1)", self.output())
            if found and httpx.get(found.group(1).removesuffix("/v1") + "/health").status_code == 200:
                self.url = found.group(1)
                break
            time.sleep(0.2)
        if not self.url:
            raise RuntimeError(self.output())
        self.client = openai.OpenAI(base_url=self.url, api_key="x", max_retries=0, timeout=600)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

    def states(self) -> dict[str, str]:
        return {m.id: m.model_extra["status"]["state"] for m in self.client.models.list().data}  # type: ignore[index]

    def complete(self, model: str, prompt: str) -> str:
        return self.client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0).choices[0].text

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-gib", type=float, default=0.86,
                        help="holds two of the three, not all (their weights and KV: 351, 517 and 17 MiB)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    save_random_hf_model(folder / "qwen3", hf_configs()["qwen3"])
    models = {"smollm2": str(pull("smollm2-135m")), "gemma3": str(pull("gemma3-270m")), "qwen3": str(folder / "qwen3")}
    alone = {}
    for name, source in models.items():
        server = Server(source, "--served-model-name", name)
        alone[name] = [server.complete(name, p) for p in PROMPTS]
        server.stop()
    file = folder / "models.toml"
    file.write_text("".join(f'[[models]]\nname = "{n}"\nsource = "{s}"\n\n' for n, s in models.items()))
    server = Server("--models-file", str(file))  # the default budget: all three load at start
    together: dict[str, list[str]] = {name: [] for name in models}
    threads = [threading.Thread(target=lambda n=n: together[n].extend(server.complete(n, p) for p in PROMPTS))
               for n in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("three models at once, interleaved: the same tokens as each alone:", together == alone,
          {n: together[n] == alone[n] for n in models})
    server.stop()
    server = Server("--models-file", str(file), "--max-memory", f"{args.budget_gib}GiB")
    print("at start:", server.states(), f"RSS {server.rss_mib():.0f} MiB")
    together = {name: [] for name in models}
    for name in ("smollm2", "gemma3"):
        together[name] = [server.complete(name, p) for p in PROMPTS]
    before = server.rss_mib()
    started = time.perf_counter()
    together["qwen3"] = [server.complete("qwen3", p) for p in PROMPTS]  # loads it, unloading the LRU idle one
    print(f"qwen3 asked for: {time.perf_counter() - started:.2f} s for its first answers; states {server.states()}; "
          f"RSS {before:.0f} -> {server.rss_mib():.0f} MiB")
    before = server.rss_mib()
    started = time.perf_counter()
    server.complete("smollm2", "hi")  # back: another unload and load
    print(f"smollm2 asked for again: {time.perf_counter() - started:.2f} s; states {server.states()}; "
          f"RSS {before:.0f} -> {server.rss_mib():.0f} MiB")
    print("under the budget, the same tokens as each model alone:", together == alone,
          {n: together[n] == alone[n] for n in models})
    for line in server.output().splitlines():
        if " loaded " in line or "unloaded" in line:
            print(" ", line.split(": ", 1)[1])
    server.stop()


if __name__ == "__main__":
    main()
