"""PolyKV demo: start the server on the tiny model, run several agents at once, print
what each said with its timings, then stop the server."""
import concurrent.futures as cf
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from polykv_langgraph.local_server import LocalServer  # noqa: E402

SYSTEM = (
    "You are a helpful research assistant in a team of agents. Answer in one or two "
    "short sentences, plainly, without lists."
)
TASKS = [
    "Explain what a KV cache is.",
    "Why does batching make LLM serving faster?",
    "Give one tip for writing clear emails.",
    "What is the boiling point of water at sea level?",
    "Name three planets of the solar system.",
    "What does a compiler do?",
]


def agent(base: str, pool_id: int, i: int, task: str) -> dict:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}],
        "max_tokens": 64,
        "temperature": 0,
        "session_id": f"agent-{i}",
        "pool_id": pool_id,
    }
    t0 = time.time()
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    out = r.json()
    out["wall_s"] = time.time() - t0
    return out


def main() -> None:
    server = LocalServer("-c", "4096", "--parallel", str(len(TASKS)))
    base = server.start()
    try:
        # The shared system block becomes a pool: prefilled once, borrowed by every agent.
        pool = httpx.post(base + "/polykv/pools", json={"messages": [{"role": "system", "content": SYSTEM}]}).json()
        pool_id = pool["pool_id"]
        print(f"polykv serving at {base}; pool {pool_id} holds the {pool['prefix_len']}-token system block")
        print(f"{len(TASKS)} agents start together, attached to pool {pool_id}\n")
        t0 = time.time()
        with cf.ThreadPoolExecutor(len(TASKS)) as ex:
            results = list(ex.map(lambda a: agent(base, pool_id, *a), enumerate(TASKS)))
        wall = time.time() - t0
        total = 0
        for i, (task, res) in enumerate(zip(TASKS, results)):
            t = res["timings"]
            total += t["predicted_n"]
            print(f"[agent-{i}] {task}")
            print(f"  -> {res['choices'][0]['message']['content'].strip()}")
            print(
                f"  prompt {t['prompt_n']} tok in {t['prompt_ms']:.0f} ms (+{t['cache_n']} from the pool), "
                f"{t['predicted_n']} tok at {t['predicted_per_second']:.1f} tok/s (EWMA {t['tps_ewma']:.1f})\n"
            )
        print(f"all agents done in {wall:.2f} s; aggregate {total / wall:.1f} generated tok/s")
        tree = httpx.get(base + "/polykv/pools").json()
        for p in tree["pools"]:
            print(
                f"pool {p['pool_id']}: prefix {p['prefix_len']} tokens, own {p['own_kv_bytes'] // 1024} KiB, "
                f"subtree {p['subtree_kv_bytes'] // 1024} KiB, {len(p['sessions'])} sessions"
            )
        unpooled = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in results)
        print(
            f"KV cells in use: {tree['kv_cells_used']} (each agent copying the prefix would need ~{unpooled})"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
