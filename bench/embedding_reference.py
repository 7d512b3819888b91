"""Records llama-server's ``/v1/embeddings`` vectors for the embedded SmolLM2 into the fixture
``tests/engine/embedding_reference.<vector set>.json`` (this machine's:
``tests/references.py``), which ``tests/engine/test_embedding_reference.py`` holds kvwarm's to
where no llama-server is at hand (CI).

    python bench/embedding_reference.py            # rewrite the fixture
    python bench/embedding_reference.py --check    # compare, rewrite nothing

The peer is ``bench/peer.py``'s llama-server, built from the pinned llama.cpp, run with
``--embeddings --pooling mean -np 1 -fa off``: SmolLM2's GGUF declares no pooling, which
llama-server takes as none (its ``/v1/embeddings`` refuses that) and kvwarm as mean; one input
per forward pass; and the attention kernel kvwarm runs on the CPU. With flash attention on
both sides the vectors are the same too (2e-8, measured); with it on in llama-server alone
they differ by up to 4e-3 in a value (cosine 0.9999).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from tests import references  # noqa: E402

from kvwarm.embedded import default_model_path  # noqa: E402
from multiturn import free_port, post, wait_ready  # noqa: E402
from peer import llama_server  # noqa: E402

FIXTURE = ROOT / "tests" / "engine" / "embedding_reference.json"
INPUTS = [
    "The capital of France is Paris.",
    "Cats that live near harbours often eat fish left by the boats.",
    "Ünïcödé text: 猫は魚を食べる",
]
FLAGS = ["--embeddings", "--pooling", "mean", "-np", "1", "-c", "512", "-b", "512", "-ub", "512",
         "-fa", "off"]  # fmt: skip


def vectors(model: Path) -> tuple[list[list[float]], int]:
    port = free_port()
    proc = subprocess.Popen(
        [str(llama_server()), "--host", "127.0.0.1", "--port", str(port), "-m", str(model),
         "--no-webui", *FLAGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc)
        out = post(f"http://127.0.0.1:{port}/v1/embeddings", {"input": INPUTS})
    finally:
        proc.terminate()
        proc.wait(60)
    data = out["data"]
    usage = out["usage"]
    assert isinstance(data, list) and isinstance(usage, dict)
    by_index = {int(d["index"]): [float(x) for x in d["embedding"]] for d in data}
    return [by_index[i] for i in range(len(INPUTS))], int(usage["prompt_tokens"])


def record() -> dict[str, object]:
    model = default_model_path()
    found, n_tokens = vectors(model)
    return {
        "about": "llama-server /v1/embeddings vectors of the embedded SmolLM2; written by "
        "bench/embedding_reference.py",
        "llama_server_flags": FLAGS,
        "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "inputs": INPUTS,
        "prompt_tokens": n_tokens,
        "vectors": found,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the fixture only")
    args = parser.parse_args(argv)
    fresh = record()
    if args.check:
        old = json.loads(references.fixture(FIXTURE).read_text())
        pairs = zip(fresh["vectors"], old["vectors"], strict=True)  # type: ignore[call-overload]
        worst = max(abs(a - b) for new, then in pairs for a, b in zip(new, then, strict=True))
        print(f"largest difference from the fixture: {worst:.3g}")
        return 0 if worst <= 1e-6 else 1
    mine = references.fixture(FIXTURE)  # this machine's vector set's file
    mine.write_text(json.dumps(fresh) + "\n")
    print(f"wrote {mine.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
