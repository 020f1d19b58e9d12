#!/usr/bin/env python3
"""Load test for `baton serve`: N concurrent streaming chat clients for a fixed time (and at most a fixed number
of requests). Reports p50/p99 time to first token, aggregate generated tokens/s, how many requests completed,
got 429 or failed, and (with --pid) the server's peak resident memory. Standard library only.

    python3 scripts/serve_load.py --url http://127.0.0.1:8080 --clients 4 --seconds 60 --max-tokens 32 --pid PID
"""
import argparse, http.client, json, threading, time, urllib.parse

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List five animals that live in the desert.",
    "What is the boiling point of water in Fahrenheit?",
    "Give me a recipe idea with potatoes.",
    "Describe the color blue to someone who cannot see.",
    "Why is the sky blue?",
    "Name three famous painters and one work of each.",
]


def one(url, prompt, max_tokens, key):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"model": args.model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", body, headers)
    r = c.getresponse()
    if r.status != 200:
        r.read()
        return r.status, None, 0, time.monotonic() - t0
    ttft, tokens, ok = None, 0, False
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            ok = True
            break
        ev = json.loads(data)
        if "error" in ev:
            break
        ch = ev.get("choices") or []
        if ch and ch[0].get("delta", {}).get("content") and ttft is None:
            ttft = time.monotonic() - t0
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
    c.close()
    return (200 if ok else 599), ttft, tokens, time.monotonic() - t0


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for l in f:
                if l.startswith("VmRSS:"):
                    return int(l.split()[1])
    except OSError:
        return 0
    return 0


ap = argparse.ArgumentParser()
ap.add_argument("--url", default="http://127.0.0.1:8080")
ap.add_argument("--model", default="smollm2")
ap.add_argument("--clients", type=int, default=4)
ap.add_argument("--seconds", type=float, default=60)
ap.add_argument("--max-requests", type=int, default=10000)
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--api-key")
ap.add_argument("--pid", type=int)
args = ap.parse_args()

lock = threading.Lock()
results, started = [], [0]
deadline = time.monotonic() + args.seconds
peak = [0]


def client(i):
    k = i
    while time.monotonic() < deadline:
        with lock:
            if started[0] >= args.max_requests:
                return
            started[0] += 1
        try:
            res = one(args.url, PROMPTS[k % len(PROMPTS)], args.max_tokens, args.api_key)
        except Exception as e:  # a connection error counts as a failure, the run goes on
            res = (598, None, 0, 0.0)
        with lock:
            results.append(res)
        if res[0] == 429:
            time.sleep(1.0)  # what Retry-After asks
        k += args.clients


def watch():
    while time.monotonic() < deadline + 5 and args.pid:
        peak[0] = max(peak[0], rss_kib(args.pid))
        time.sleep(0.5)


t0 = time.monotonic()
rss0 = rss_kib(args.pid) if args.pid else 0
ws = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
w = threading.Thread(target=watch, daemon=True)
w.start()
for t in ws:
    t.start()
for t in ws:
    t.join()
wall = time.monotonic() - t0
ok = [r for r in results if r[0] == 200]
ttfts = sorted(r[1] for r in ok if r[1] is not None)
pct = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else float("nan")
toks = sum(r[2] for r in ok)
print(json.dumps({
    "clients": args.clients, "seconds": round(wall, 1), "requests": len(results), "completed": len(ok),
    "rejected_429": sum(r[0] == 429 for r in results), "failed": sum(r[0] not in (200, 429) for r in results),
    "ttft_p50_s": round(pct(0.5), 3), "ttft_p99_s": round(pct(0.99), 3),
    "tokens": toks, "tokens_per_s": round(toks / wall, 2),
    "per_client_tokens_per_s": round(toks / wall / args.clients, 2),
    "rss_start_mib": round(rss0 / 1024, 1), "rss_peak_mib": round(peak[0] / 1024, 1),
}))
