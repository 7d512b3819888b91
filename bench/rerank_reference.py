"""Records llama-server's rerank scores on the tests' tiny rerankers into the fixture
``tests/engine/rerank_reference.<vector set>.json`` (this machine's: ``tests/references.py``),
which ``tests/engine/test_rerank_model.py`` holds kvwarm's scores to (5e-5, order included)
where no llama-server is at hand (CI).

    python bench/rerank_reference.py            # rewrite the fixture
    python bench/rerank_reference.py --check    # compare, rewrite nothing

Both models are written by ``tests/tinymodels.write_reranker`` (seeded: the same bytes every
time; the fixture keeps each file's sha256, and the test refuses a file that differs rather
than report a score mismatch). The peer is ``bench/peer.py``'s llama-server, built from the
pinned llama.cpp, run with ``--rerank -np 1 -fa off``: one document per forward pass (the score
of each alone: llama.cpp's numbers move by ~1e-6 with what shares a pass) and the attention
kernel kvwarm runs on the CPU (with flash attention llama-server's own scores move by up to
6e-4 between ``-np 1`` and ``-np 4``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from tests import references  # noqa: E402
from tests.tinymodels import write_reranker  # noqa: E402

from multiturn import free_port, post, wait_ready  # noqa: E402
from peer import llama_server  # noqa: E402

FIXTURE = ROOT / "tests" / "engine" / "rerank_reference.json"
QUERY = "What do cats eat when they live by the sea?"
DOCUMENTS = [
    "Cats that live near harbours often eat fish left by the boats.",
    "The lighthouse keeper painted the tower white every spring.",
    "A cat's diet is mostly meat: birds, mice and, by the sea, fish.",
    "Ferries leave the harbour twice a day in summer.",
    "",
    "Ünïcödé text: 猫は魚を食べる — cats eat fish.",
    "Seagulls steal chips from tourists on the pier.",
    "Kittens drink milk; grown cats are hunters.",
]
#: The server's context: one slot of 512 tokens, a whole document per ubatch (an encoder's
#: prompt must fit one).
FLAGS = ["--rerank", "-np", "1", "-c", "512", "-b", "512", "-ub", "512", "-fa", "off"]


def scores(model: Path) -> list[float]:
    port = free_port()
    proc = subprocess.Popen(
        [str(llama_server()), "--host", "127.0.0.1", "--port", str(port), "-m", str(model),
         "--no-webui", *FLAGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc)
        out = post(f"http://127.0.0.1:{port}/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    finally:
        proc.terminate()
        proc.wait(60)
    results = out["results"]
    assert isinstance(results, list)
    by_index = {int(r["index"]): float(r["relevance_score"]) for r in results}
    return [by_index[i] for i in range(len(DOCUMENTS))]


def record() -> dict[str, object]:
    models: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("decoder", "encoder"):
            path = write_reranker(Path(tmp) / f"{kind}.gguf", kind)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            models[kind] = {"sha256": digest, "scores": scores(path)}
    return {
        "about": "llama-server --rerank scores on tests/tinymodels.write_reranker's models; "
        "written by bench/rerank_reference.py",
        "llama_server_flags": FLAGS,
        "query": QUERY,
        "documents": DOCUMENTS,
        "models": models,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the fixture only")
    args = parser.parse_args(argv)
    fresh = record()
    if args.check:
        old = json.loads(references.fixture(FIXTURE).read_text())
        worst = 0.0
        for kind, model in fresh["models"].items():  # type: ignore[attr-defined]
            then = old["models"][kind]
            if then["sha256"] != model["sha256"]:
                print(f"{kind}: the model file changed ({model['sha256'][:12]})")
                return 1
            pairs = zip(model["scores"], then["scores"], strict=True)
            worst = max(worst, *(abs(a - b) for a, b in pairs))
        print(f"largest difference from the fixture: {worst:.3g}")
        return 0 if worst <= 1e-5 else 1
    mine = references.fixture(FIXTURE)  # this machine's vector set's file
    mine.write_text(json.dumps(fresh, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {mine.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
