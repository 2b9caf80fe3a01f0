"""The disaggregated run as real processes: prefill and decode over gloo on 127.0.0.1.

Usage::

  python -m torch_bridge.demo.disagg_processes [--model M] [--seed S] [--kill-after N]
                                               [--no-kill] [--timeout SECONDS]

:func:`run` (this process, the *owner*) hosts a ``torch.distributed.TCPStore`` on
127.0.0.1 (the record store and the rendezvous), then starts:

1. the prefill process: prefills every request (:func:`torch_bridge.demo.disagg.prefill`),
   then for each session (one per decode incarnation) joins a gloo group with the
   decode process and sends it every request's :class:`~torch_bridge.handoff.Handoff`
   (record bytes + prompt ids + rotated KV); a session whose peer dies ends with a
   RuntimeError and the next one waits for the restarted peer;
2. the decode process: a :class:`~torch_bridge.demo.disagg.DecodeNode` receiving one
   new request a step and publishing every request's record to the store every step.
   The first one stops after the commit of step ``kill_after``, before publishing;
   the owner SIGKILLs it there and starts a second one, which resumes every request
   from its last published record.

Each process logs its step rows to the store; the owner collects them, the final
records and the exit codes, and :func:`~torch_bridge.demo.disagg.verify` checks them.
Every wait is bounded by ``timeout``; on any failure the owner kills what it started.
Gloo is bound to the loopback interface (``GLOO_SOCKET_IFNAME=lo`` unless set).

Output: the run's rows, then ``verdict: PASS ...`` (exit 0) or ``verdict: FAIL ...``
(exit 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import torch_bridge
from torch_bridge.demo.disagg import DecodeNode, DisaggReport, DisaggSpec, new_node, prefill, verify
from torch_bridge.demo.model import MODELS, TOLERANCE
from torch_bridge.handoff import RecordStore, join_session, recv_handoff, send_handoff

__all__ = ["LOOPBACK", "main", "report_lines", "run"]

LOOPBACK = "127.0.0.1"
# The children run this module with -m (where __name__ is "__main__").
_MODULE = "torch_bridge.demo.disagg_processes"
# A process's store operations and gloo calls give up after this long (a hung peer).
_PEER_TIMEOUT = 60.0
# Decode incarnations the prefill process serves before it gives up.
_MAX_SESSIONS = 4
_POLL = 0.02


def _connect(port: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, is_master=False,
                         timeout=datetime.timedelta(seconds=_PEER_TIMEOUT))


def _logger(store: dist.Store, name: str):
    def log(row: dict) -> None:
        index = store.add(f"log/{name}/n", 1) - 1
        store.set(f"log/{name}/{index}", json.dumps(row))
    return log


def _rows(store: dist.Store, name: str) -> List[dict]:
    count = store.add(f"log/{name}/n", 0)
    return [json.loads(store.get(f"log/{name}/{i}")) for i in range(count)]


# ---------------------------------------------------------------------- the two processes


def _prefill_process(port: int, spec: DisaggSpec) -> int:
    store = _connect(port)
    rows: List[dict] = []
    log = _logger(store, "prefill")

    def keep(row: dict) -> None:
        rows.append(row)
        log(row)

    handoffs = prefill(spec, new_node(spec, "prefill"), keep)
    failed = any(row["failures"] for row in rows)
    for session in range(_MAX_SESSIONS):
        # A rendezvous that fails (no decode process came) raises out of the process.
        with join_session(store, session, rank=0, timeout=_PEER_TIMEOUT):
            try:
                dist.send(torch.tensor([len(handoffs)]), 1)
                for handoff in handoffs:
                    send_handoff(handoff, 1)
                done = torch.zeros(1, dtype=torch.int64)
                dist.recv(done, 1)
            except RuntimeError as e:   # the decode process died: serve its next incarnation
                store.set(f"lost/{session}", str(e).splitlines()[0])
                continue
        return 1 if failed else 0
    return 1


def _decode_process(port: int, spec: DisaggSpec, incarnation: int,
                    hold_after: Optional[int]) -> int:
    store = _connect(port)

    def hold() -> None:
        store.set(f"held/{incarnation}", "1")
        time.sleep(_PEER_TIMEOUT)   # the owner kills this process here
        raise SystemExit(f"decode{incarnation}: held {_PEER_TIMEOUT:g} s and not killed")

    node = DecodeNode(spec, RecordStore(store), _logger(store, f"decode{incarnation}"),
                      hold_after=hold_after, hold=hold)
    with join_session(store, incarnation, rank=1, timeout=_PEER_TIMEOUT):
        total = torch.zeros(1, dtype=torch.int64)
        dist.recv(total, 0)
        node.serve(lambda: recv_handoff(0), int(total))
        dist.send(torch.ones(1, dtype=torch.int64), 0)
    return 1 if node.failed else 0


# ---------------------------------------------------------------------- the owner


class _Children:
    """The processes :func:`run` started, their output files, and their cleanup."""

    def __init__(self, port: int, spec: DisaggSpec, workdir: pathlib.Path, deadline: float):
        self.port, self.spec, self.workdir, self.deadline = port, spec, workdir, deadline
        self.procs: Dict[str, subprocess.Popen] = {}
        root = str(pathlib.Path(torch_bridge.__file__).resolve().parents[1])
        path = os.environ.get("PYTHONPATH")
        self.env = dict(os.environ, PYTHONPATH=root if not path else f"{root}{os.pathsep}{path}",
                        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS") or "cpu")
        self.env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.env.setdefault("OMP_NUM_THREADS", "1")

    def start(self, name: str, *args: str) -> None:
        command = [sys.executable, "-m", _MODULE, "--port", str(self.port),
                   "--spec", self.spec.to_json(), *args]
        with open(self.workdir / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                                env=self.env)

    def wait_key(self, store: dist.Store, key: str, name: str) -> None:
        """Until ``key`` is in the store; fails when ``name`` exits first or time runs out."""
        while not store.check([key]):
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode} before "
                                   f"setting {key!r}\n{self.tail(name)}")
            self._check_time(f"waiting for {key!r}")
            time.sleep(_POLL)

    def wait_exit(self, name: str) -> int:
        try:
            return self.procs[name].wait(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} still running at the deadline\n{self.tail(name)}") from None

    def kill(self, name: str) -> int:
        self.procs[name].send_signal(signal.SIGKILL)
        return self.procs[name].wait()

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def tail(self, name: str, lines: int = 30) -> str:
        text = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(f"  [{name}] {line}" for line in text[-lines:])

    def _check_time(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"deadline passed {what}\n" +
                               "\n".join(self.tail(name) for name in self.procs))


def run(spec: DisaggSpec = DisaggSpec(), *, timeout: float = 120.0) -> DisaggReport:
    """Run the prefill and decode processes (decode killed at ``spec.kill_after`` and
    restarted), collect their logs and records, and :func:`verify` them.

    Raises:
      TimeoutError: a process still ran, or a key was still missing, after ``timeout``
        seconds (every child is killed first; the message holds their output's tail).
      RuntimeError: a child exited before it reached the point the run waits for.
    """
    deadline = time.monotonic() + timeout
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="jaxrope-disagg-") as workdir:
        children = _Children(store.port, spec, pathlib.Path(workdir), deadline)
        try:
            children.start("prefill", "prefill")
            exit_codes = {}
            if spec.kill_after is None:
                children.start("decode0", "decode", "--incarnation", "0")
            else:
                children.start("decode0", "decode", "--incarnation", "0",
                               "--hold-after", str(spec.kill_after))
                children.wait_key(store, "held/0", "decode0")
                exit_codes["decode0"] = children.kill("decode0")
                children.start("decode1", "decode", "--incarnation", "1")
            for name in children.procs:
                if name not in exit_codes:
                    exit_codes[name] = children.wait_exit(name)
            names = ["prefill"] + [n for n in ("decode0", "decode1") if n in children.procs]
            rows = {name: _rows(store, name) for name in names}
            records = {rid: r for rid in spec.rids
                       if (r := RecordStore(store).latest(rid)) is not None}
            lost = [store.get(f"lost/{s}").decode() for s in range(len(names) - 1)
                    if store.check([f"lost/{s}"])]
            report = verify(DisaggReport(spec, rows, records, exit_codes, lost))
            if len(lost) != len(names) - 2:
                report.failures.append(f"the prefill process lost {len(lost)} decode peers, "
                                       f"want {len(names) - 2}: {lost}")
            want = {"prefill": 0, "decode0": 0 if spec.kill_after is None else -signal.SIGKILL,
                    "decode1": 0}
            for name, code in exit_codes.items():
                if code != want[name]:
                    report.failures.append(f"{name} exited with {code}, want {want[name]}\n"
                                           f"{children.tail(name)}")
            return report
        finally:
            children.cleanup()


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="Prefill and decode in two processes (gloo on 127.0.0.1); the decode "
                    "process is killed mid-stream and restarted from its published records.")
    parser.add_argument("role", nargs="?", choices=("prefill", "decode"),
                        help=argparse.SUPPRESS)    # the children's entry
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hold-after", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-after", type=int, default=DisaggSpec.kill_after,
                        help="decode step after whose commit the decode process is killed "
                             f"(default {DisaggSpec.kill_after})")
    parser.add_argument("--no-kill", action="store_true", help="never kill the decode process")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The owner's run (no role: prints the rows and a verdict), or a child's program."""
    args = _parser().parse_args(argv)
    if args.role is not None:
        torch.set_num_threads(1)   # tiny matmuls; two processes share the cores
        spec = DisaggSpec.from_json(args.spec)
        if args.role == "prefill":
            return _prefill_process(args.port, spec)
        return _decode_process(args.port, spec, args.incarnation, args.hold_after)
    spec = DisaggSpec(model=args.model, seed=args.seed,
                      kill_after=None if args.no_kill else args.kill_after)
    started = time.perf_counter()
    report = run(spec, timeout=args.timeout)
    print("\n".join(report_lines(report, time.perf_counter() - started)))
    return 1 if report.failures else 0


def report_lines(report: DisaggReport, seconds: float) -> List[str]:
    """What ``main`` prints for a run's ``report``: its rows, each lost decode peer, and the
    verdict. The error the prefill process saw when a peer died is printed only where the
    run failed: on a passing run the one peer lost is the decode process the run killed."""
    lines = [f"{name:<8} {row['step']:>3} {row['kind']:<8} {str(row['positions']):<40} "
             f"{row['error']:.1e}  {', '.join(row['events'])}"
             for name, rows in report.rows.items() for row in rows]
    for session, error in enumerate(report.lost):
        if report.failures:
            lines.append(f"prefill: session {session}'s decode peer died: {error}")
        else:
            lines.append(f"prefill: session {session}'s decode peer (decode{session}, killed by "
                         f"this run) went away; session {session + 1} served its restart")
    summary = (f"{sum(map(len, report.rows.values()))} steps, {len(report.spec.requests)} "
               f"requests, {report.bytes_per_stream:g} bytes a stream, tolerance "
               f"{TOLERANCE:.0e}, exit codes {report.exit_codes}, {seconds:.1f} s")
    if report.failures:
        lines.append(f"verdict: FAIL — {summary}; first: {report.failures[0]}")
    else:
        lines.append(f"verdict: PASS — {summary}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
