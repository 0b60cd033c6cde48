"""Where a `generate.py` run's start-up time goes, run after run (the persistent compilation cache at work).

  python scripts/profile_startup.py --runs 2 --out bench/results/startup.json [--commit SHA] -- --max-tokens 48

Each run is a fresh process running scripts/generate.py with the arguments after `--` and a fresh or shared
compilation-cache directory (`--cache-dir`, default: a new temporary directory shared by this script's runs, so
run 1 is cold and run 2 reads what run 1 wrote). Inside each run, JAX's own monitoring events are summed per kind:
tracing (jaxpr), lowering (jaxpr -> MLIR), backend compilation (or reading it back from the cache), and the
cache's hits and misses; the slowest entries of each kind are named. Prints a table last and writes JSON.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

_MARK = "PROFILE_STARTUP_JSON "
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s"}


def child(generate_argv: list[str], cprofile: bool = False) -> None:
  """Runs generate.main in this process with JAX's monitoring listeners installed (and cProfile when asked);
  prints one JSON line."""
  t_start = time.perf_counter()
  from jax import monitoring
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  per_fun = collections.defaultdict(float)

  def on_duration(event, secs, **kw):
    key = EVENTS.get(event)
    if key:
      totals[key] += secs
      counts[key] += 1
      if kw.get("fun_name"):
        per_fun[(key, kw["fun_name"])] += secs

  def on_event(event, **kw):
    if event.startswith("/jax/compilation_cache/"):
      counts[event.rsplit("/", 1)[-1]] += 1

  monitoring.register_event_duration_secs_listener(on_duration)
  monitoring.register_event_listener(on_event)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import generate
  t_imported = time.perf_counter()
  profiler = None
  if cprofile:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
  rc = generate.main(generate_argv)
  t_end = time.perf_counter()
  hot = []
  if profiler is not None:
    import pstats
    profiler.disable()
    stats = pstats.Stats(profiler)
    for (file, line, fn), (_, ncalls, _, cum, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:60]:
      hot.append(dict(fn=f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({fn})",
                      calls=ncalls, cum_s=round(cum, 3)))
  slowest = sorted(per_fun.items(), key=lambda kv: -kv[1])[:12]
  print(_MARK + json.dumps(dict(
      rc=rc, wall_s=t_end - t_start, import_s=t_imported - t_start, **{k: totals[k] for k in EVENTS.values()},
      counts=dict(counts), slowest=[dict(kind=k, fun=f, s=s) for (k, f), s in slowest], cprofile=hot)),
      flush=True)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("--child", "--child-cprofile"):
    child(argv[1:], cprofile=argv[0] == "--child-cprofile")
    return 0
  cut = argv.index("--") if "--" in argv else len(argv)
  own, generate_argv = argv[:cut], argv[cut + 1:]
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=2)
  ap.add_argument("--cache-dir", default=None, help="compilation cache directory (default: a new temporary one)")
  ap.add_argument("--out", default="bench/results/startup.json")
  ap.add_argument("--commit", default=None)
  ap.add_argument("--cprofile", action="store_true", help="also profile each run with cProfile (top 60 by "
                  "cumulative time in the JSON; the last run's top 25 printed)")
  args = ap.parse_args(own)
  if args.runs < 1:
    ap.error("--runs must be at least 1")
  cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="mla_jax_startup_cache_")
  result = dict(commit=args.commit, cache_dir=cache_dir, generate_args=generate_argv, runs=[])
  for i in range(args.runs):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-cprofile" if args.cprofile else "--child",
                           "--compilation-cache", cache_dir,
                           *generate_argv], capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("summary:") or ln.startswith("attention")]
    if proc.returncode or not lines:
      print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
      print(f"error: run {i + 1} failed (exit status {proc.returncode})", file=sys.stderr)
      return 1
    run = dict(json.loads(lines[0][len(_MARK):]), process_s=process_s, generate_lines=summary)
    result["runs"].append(run)
    print(f"run {i + 1}: " + json.dumps({k: run[k] for k in ("process_s", "wall_s", "import_s", "trace_s",
                                                             "lower_s", "compile_s", "cache_read_s", "counts")}),
          flush=True)
    for ln in summary:
      print("   ", ln, flush=True)
  try:
    import jax
    result.update(jax=jax.__version__, device=jax.devices()[0].device_kind)
  except Exception as e:  # noqa: BLE001 - the table below is still worth printing
    result["device_error"] = repr(e)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"\n{result.get('device')}, jax {result.get('jax')}, commit {args.commit}, cache {cache_dir}")
  print(f"{'run':>3} {'process s':>9} {'import s':>8} {'trace s':>8} {'lower s':>8} {'compile s':>9} "
        f"{'hits':>5} {'misses':>6}")
  for i, r in enumerate(result["runs"]):
    c = r["counts"]
    print(f"{i + 1:>3} {r['process_s']:9.2f} {r['import_s']:8.2f} {r['trace_s']:8.2f} {r['lower_s']:8.2f} "
          f"{r['compile_s']:9.2f} {c.get('cache_hits', 0):>5} {c.get('cache_misses', 0):>6}")
  print("slowest in the last run:")
  for s in result["runs"][-1]["slowest"]:
    print(f"  {s['kind']:12} {s['s']:7.3f} s  {s['fun']}")
  if args.cprofile:
    print("cProfile, last run, by cumulative time:")
    for h in result["runs"][-1]["cprofile"][:25]:
      print(f"  {h['cum_s']:8.3f} s {h['calls']:>8}  {h['fn']}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
