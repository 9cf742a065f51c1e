"""How long a registry read takes to report a tracking server that is down, with the CLI's MLflow client settings
(deploy/registry.py `fail_fast_mlflow_client`) and with MLflow's own (7 retries with a doubling backoff).

    python scripts/bench_mlflow_outage.py [--out DIR]      # about 4 minutes: MLflow's own retries

Each case runs in a fresh process (MLflow reads its settings per call, but the process environment is the
setting), against a closed port on 127.0.0.1. Prints and writes (results.json, results.md) the seconds until
`RegistryUnavailable`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT")

CASE = r"""
import json, socket, sys, time
if sys.argv[1] == "cli":
    from deploy.registry import fail_fast_mlflow_client
    fail_fast_mlflow_client()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
from deploy.registry import Registry, RegistryUnavailable
t0 = time.monotonic()
try:
    Registry(None, tracking_uri=f"http://127.0.0.1:{port}").champion()
    print(json.dumps({"error": None}))
except RegistryUnavailable as e:
    print(json.dumps({"seconds": round(time.monotonic() - t0, 1), "error": str(e)[:200]}))
"""


def run_case(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    print(f"[outage] {name}: reading the champion from a closed port ...", flush=True)
    out = subprocess.run([sys.executable, "-c", CASE, name], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{name}: the case failed:\n{out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"[outage] {name}: {res.get('seconds')} s to: {res.get('error')}", flush=True)
    return {"case": name, **res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json and results.md")
    args = ap.parse_args(argv)
    rows = [run_case("cli"), run_case("mlflow-defaults")]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
        lines = ["| MLflow client settings | seconds to RegistryUnavailable |", "|---|---:|"]
        names = {"cli": "the CLI's (2 retries, backoff factor 1, 60-s timeout)",
                 "mlflow-defaults": "MLflow's own (7 retries, backoff factor 2, 120-s timeout)"}
        lines += [f"| {names[r['case']]} | {r.get('seconds')} |" for r in rows]
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
