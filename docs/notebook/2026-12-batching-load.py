"""Server arms on a memory wall (issue 52, docs/notebook/2026-12-batching.md): 4 concurrent chat
requests against the same 4 one after another (a fresh server and cold pages per arm, in a memory
cgroup of 0.8x the model, arms rotated), or a load of 16 concurrent clients.

usage: .venv/bin/python docs/notebook/2026-12-batching-load.py MODEL CACHE MAX_BATCH TOKENS
       pair|load [ROUNDS] [serve flags...]
"""
import json, os, re, socket, statistics, subprocess, sys, threading, time, urllib.request
from pathlib import Path
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from engine.measure.memory_cgroup import MemoryCgroup
from engine.experts.page_cache import FileResidency, evict_file

MODEL = Path(sys.argv[1]); CACHE = sys.argv[2]; BATCH = int(sys.argv[3]); TOKENS = int(sys.argv[4])
PHASE = sys.argv[5]  # "pair" or "load"
ROUNDS = int(sys.argv[6]) if len(sys.argv) > 6 else 1
EXTRA = sys.argv[7:]
size = sum(f.stat().st_size for f in MODEL.glob("*.safetensors"))
TEXTS = ["Write a short poem about the sea and the wind.", "Explain how a bicycle stays upright while moving.",
         "List three facts about the moon and its orbit.", "Tell a story about a cat who learns to read.",
         "Describe a walk through a forest in autumn.", "What makes bread rise when it bakes?",
         "Give advice to someone learning to swim.", "Summarise the plot of a heist film you invent."]

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def cold():
    for f in MODEL.glob("*.safetensors"): evict_file(f)
    r = FileResidency(MODEL / "model.safetensors"); frac = r.resident_bytes(0, r.size) / r.size; r.close(); return frac

def start(batch):
    port = free_port()
    group = MemoryCgroup.create(int(0.8 * size), f"edge0-load-{os.getpid()}-{port}")
    err = open(f"/tmp/edge0-serve-{port}.log", "w")
    cmd = [str(Path(sys.executable).parent / "edge0"), "serve", str(MODEL), "--mode", "on-demand", "--expert-cache", CACHE,
           "--max-batch", str(batch), "--port", str(port), "--queue-limit", "16", *EXTRA]
    proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, preexec_fn=group.join, cwd=str(REPO))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url + "/v1/models", timeout=2).status == 200:
                body = open(err.name).read()
                if "ready" in body: break
        except Exception: pass
        time.sleep(0.5)
    return proc, url, group, err.name

def ask(url, i, out):
    body = json.dumps({"model": "edge0", "messages": [{"role": "user", "content": TEXTS[i % len(TEXTS)]}],
                       "max_tokens": TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        r = urllib.request.urlopen(req, timeout=3600); data = json.loads(r.read())
        out[i] = (r.status, time.perf_counter() - t, data["choices"][0]["message"]["content"], data.get("edge0", {}))
    except urllib.error.HTTPError as e:
        out[i] = (e.code, time.perf_counter() - t, e.read()[:200], {})

def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)", text, re.M); return float(m.group(1)) if m else None

def arm(name, n):
    frac = cold()
    proc, url, group, log = start(BATCH if name != "sequential" else 1)
    out = {}
    t0 = time.perf_counter()
    if name == "sequential":
        for i in range(n): ask(url, i, out)
    else:
        ts = [threading.Thread(target=ask, args=(url, i, out)) for i in range(n)]
        [t.start() for t in ts]; [t.join() for t in ts]
    wall = time.perf_counter() - t0
    peak = metric(url, "edge0_process_peak_rss_bytes")
    cg_peak = None
    for f in ("memory.peak", "memory.max_usage_in_bytes"):
        if (group.path / f).exists(): cg_peak = int((group.path / f).read_text())
    proc.terminate(); proc.wait(60)
    plan = re.search(r"memory plan[^\n]*", open(log).read())
    try: group.remove()
    except Exception: pass
    statuses = [out[i][0] for i in range(n)]
    rows = [out[i][3].get("batch", {}).get("rows_per_step") for i in range(n)]
    print(f"{name} x{n}: {wall:.1f} s, statuses {sorted(set(statuses))} ({statuses.count(200)}/{n} ok), cold before {frac:.4f}, "
          f"process peak RSS {peak/2**20 if peak else 0:.0f} MiB, cgroup peak {cg_peak/2**20 if cg_peak else 0:.0f} MiB of limit {0.8*size/2**20:.0f}, rows/step {rows}", flush=True)
    print("   ", plan.group(0) if plan else "no plan line", flush=True)
    return wall, [out[i][2] for i in range(n)]

if PHASE == "pair":
    res = {"sequential": [], "concurrent": []}; texts = {}
    for r in range(ROUNDS):
        for name in (["sequential", "concurrent"] if r % 2 == 0 else ["concurrent", "sequential"]):
            w, t = arm(name, 4); res[name].append(w); texts[name] = t
    s, c = statistics.median(res["sequential"]), statistics.median(res["concurrent"])
    print(f"median: 4 one after another {s:.1f} s, 4 concurrent {c:.1f} s: {s/c:.2f}x; same text {texts['sequential'] == texts['concurrent']}")
else:
    arm("load", 16)
