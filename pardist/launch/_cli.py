"""``python -m pardist.launch``: fastai.launch's convenience on torchrun's own machinery.

::

    python -m pardist.launch --nproc 2 train.py --epochs 8          # 2 processes here
    python -m pardist.launch --gpus 0,1 train.py                     # GPUs 0 and 1
    python -m pardist.launch --nnodes 2 --nproc 4 \\
        --rdzv-endpoint node0:29400 train.py                        # on each of 2 machines

Every torchrun option works too (``--max-restarts``, ``--rdzv-conf``, ``--local-addr``,
...): the arguments are parsed by torchrun's own parser and run by its elastic
agent. What pardist adds, and why:

* ``--gpus 0,1`` and ``--nproc N``: fastai's names; one process per GPU by default.
* One machine needs no port: the rendezvous store gets one from the OS.
* Restarts work. torch 2.13's agent reuses one store across restarts, so a
  restarted group can read the previous group's gloo addresses and fail with
  ``Gloo connectFullMesh failed ... Connection refused``; pardist sets torch's
  own switch ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which gives each restart a
  fresh store.
* A port given by hand is checked first. A rendezvous endpoint held by another
  program, or by another job's store (a one-machine job always hosts its own),
  makes torch's client wait forever; pardist says so in seconds.
* The join is bounded (``--join-timeout``, torch's ``join_timeout``): when a node
  fails, the nodes left wait that long for it, then every worker exits; a node
  whose workers never start (its rendezvous is another job's) stops too.
* A failure names the rank that caused it, in one line: the rank that raised
  (its traceback is above, or in its log file), that exited with a code of its
  own, that was killed by a signal, or that stopped responding while the others
  timed out waiting for it, instead of torchrun's table of every rank's exit; a
  script's own clean error (``sys.exit(2)``) is passed on as the launcher's exit code.
* Shared-memory segments of workers that were killed are removed when the job ends.
* The first node is found by address: the node that owns the rendezvous address
  hosts the store (torch's ``is_host``), which torch's hostname guess gets wrong
  inside containers and network namespaces.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence

__all__ = ["DEFAULT_JOIN_TIMEOUT_S", "main", "prepare"]

# torch waits 600 s for a missing node. Two minutes covers machines that start a
# little apart and ends a job whose node died without tying up the others.
DEFAULT_JOIN_TIMEOUT_S = 120
WORKER_JOIN_S = 300  # workers' wait for each other to start, at least
WHERE = "pardist.launch"


def _parser():
    from pardist.runtime import torchrun_parser

    parser = torchrun_parser()
    parser.prog = "python -m pardist.launch"
    parser.description = (
        "Run a training script in N processes per machine with torchrun's elastic agent. "
        "Takes every torchrun option, plus --gpus, --nproc and --join-timeout."
    )
    parser.add_argument(
        "--gpus",
        type=str,
        default=None,
        help="GPUs to use, e.g. '0,1' or 'all' (fastai's option): sets "
        "CUDA_VISIBLE_DEVICES and one process per GPU.",
    )
    parser.add_argument(
        "--nproc",
        type=str,
        default=None,
        help="processes per machine (torchrun's --nproc-per-node); default: "
        "one per visible GPU, else 1.",
    )
    parser.add_argument(
        "--join-timeout",
        type=int,
        default=DEFAULT_JOIN_TIMEOUT_S,
        help="seconds to wait for every node to join, at the start and after "
        f"a restart (default {DEFAULT_JOIN_TIMEOUT_S}); then the job fails.",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="one machine: a rank that dies is left behind and the others train on "
        "without it, from the step that saw it go (docs/keep_going.md); with "
        "--max-restarts K, up to K replacements join at the survivors' next "
        "pardist.checkpoint.save. The job exits 0 when the survivors finish.",
    )
    # None means "not given", so that --rdzv-endpoint alone can choose c10d.
    parser.set_defaults(rdzv_backend=os.environ.get("PET_RDZV_BACKEND"))
    return parser


def _gpu_count() -> int:
    import torch

    # device_count does not create a CUDA context in this (agent) process.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    return host.strip("[]"), int(port) if port else default_port


def _add_conf(conf: str, key: str, value) -> str:
    return f"{conf},{key}={value}" if conf else f"{key}={value}"


def prepare(argv: Sequence[str], *, check_ports: bool = True):
    """Turn pardist.launch's command line into torchrun's arguments and environment.

    Args:
        argv: the command line after ``python -m pardist.launch``.
        check_ports: look at a rendezvous port given by hand before using it.

    Returns:
        ``(args, env)``: the namespace ``torch.distributed.run.run`` takes, and the
        environment variables to set for the agent and its workers.

    Raises:
        pardist.launch._ports.PortInUseError: a port given by hand belongs to another program.
        SystemExit: for a malformed command line, with argparse's message.

    Example:
        >>> from pardist.launch import prepare
        >>> args, env = prepare(['--nproc', '2', 'train.py', '--lr', '0.1'])
        >>> args.nproc_per_node, args.rdzv_endpoint, args.training_script_args
        ('2', 'localhost:0', ['--lr', '0.1'])
        >>> env['TORCH_DISABLE_SHARE_RDZV_TCP_STORE']
        '1'
    """
    from torch.distributed.run import parse_min_max_nnodes

    from pardist.launch import _ports
    from pardist.runtime import matches_machine_hostname

    args = _parser().parse_args(list(argv))
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if args.gpus is not None and args.gpus != "all":
        gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if not gpus:
            raise SystemExit(f"{WHERE}: --gpus {args.gpus!r} names no GPU; give e.g. --gpus 0,1.")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        count = len(gpus)
    else:
        count = _gpu_count()
    if args.nproc is not None:
        args.nproc_per_node = args.nproc
    elif (
        "--nproc-per-node" not in argv
        and "--nproc_per_node" not in argv
        and not any(a.startswith(("--nproc-per-node=", "--nproc_per_node=")) for a in argv)
    ):
        args.nproc_per_node = str(max(count, 1))

    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.keep_going and max_nodes != 1:
        raise SystemExit(
            f"{WHERE}: --keep-going runs on one machine (a lost rank is left behind, or "
            "replaced under --max-restarts); drop --nnodes, or --keep-going."
        )
    if args.rdzv_backend is None:
        single = max_nodes == 1 and args.master_port is None
        args.rdzv_backend = "c10d" if args.rdzv_endpoint or single else "static"
    if max_nodes == 1 and not args.rdzv_endpoint and args.master_port is None:
        # One machine: torchrun's --standalone, a store on a port the OS picks.
        args.standalone = True
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        # The workers' own store too: rank 0 hosts it at this address, on loopback.
        args.local_addr = args.local_addr or "127.0.0.1"
        args.rdzv_id = str(uuid.uuid4())
        args.standalone = False  # done here, so that run() keeps our endpoint

    if args.rdzv_backend == "c10d":
        if args.rdzv_endpoint == "":
            raise SystemExit(
                f"{WHERE}: --nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, "
                "the address of the first node (the same on every node)."
            )
        conf = {
            k.strip(): v.strip()
            for k, v in (item.split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)
        }
        if "join_timeout" in conf:
            args.join_timeout = int(conf["join_timeout"])
        else:
            args.rdzv_conf = _add_conf(args.rdzv_conf, "join_timeout", args.join_timeout)
        host, port = _split_endpoint(args.rdzv_endpoint, 29400)
        if port != 0:
            # One machine hosts its own store: one already there belongs to another job.
            must_host = conf.get("is_host", "").lower() in ("1", "true", "yes", "y") or (
                max_nodes == 1 and _ports.is_local_address(host)
            )
            owner = "free"
            if check_ports:
                owner = _ports.check_endpoint(
                    host, port, must_host=must_host, where=WHERE, option="--rdzv-endpoint"
                )
            if (
                "is_host" not in conf
                and owner == "free"
                and _ports.is_local_address(host)
                and not matches_machine_hostname(host)
            ):
                # This node owns the endpoint's address, so it hosts the store; torch's
                # guess goes by hostname, which containers and namespaces share.
                args.rdzv_conf = _add_conf(args.rdzv_conf, "is_host", 1)
    elif args.rdzv_backend == "static" and check_ports:
        port = 29500 if args.master_port is None else args.master_port
        _ports.check_endpoint(
            args.master_addr,
            port,
            must_host=args.node_rank == 0,
            where=WHERE,
            option="--master-port",
        )
    if args.master_port is None:  # torch's run() fills it in since 2.12; 2.11's reads it as is
        args.master_port = 29500
    # How long workers wait for each other to start (imports on a loaded machine take long;
    # a lost node is the agents' to detect, within --join-timeout).
    env["PARDIST_JOIN_TIMEOUT"] = str(max(args.join_timeout, WORKER_JOIN_S))
    # The workers' store keys behind a secret of this run (runtime._join.secret_keys): drawn
    # here on one machine; on several, each node's launcher must be given the same one.
    from pardist.runtime import _join

    if os.environ.get(_join.SECRET):
        env[_join.SECRET] = os.environ[_join.SECRET]
    elif max_nodes == 1:
        env[_join.SECRET] = secrets.token_hex(16)
    return args, env


def _children() -> list[int]:
    """This process's child processes (the agent's workers), from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # the command name (field 2) may hold spaces; the ppid follows its ')'
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _stop_node() -> None:
    for pid in _children():  # each worker leads its own session: stop its group too
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    os._exit(1)


JOIN_GRACE_S = 15.0  # past --join-timeout, before a node whose workers never started stops


def _watch(host: str, port: int, patience: float, interval: float = 2.0) -> None:
    """Stop this node if the rendezvous endpoint stays unreachable for ``patience`` s.

    torch's agent talks to the store on the first node with a client that can
    block for many minutes once that node is gone (no timeout applies to a
    connection whose peer vanished), so a lost first node would leave the other
    nodes' agents waiting indefinitely. Nor does torch bound the wait of a node
    that joined a rendezvous another job has closed (a reused endpoint): if no
    worker has started ``patience`` s (plus a grace) after launch, this node stops
    too. This daemon thread bounds both waits.
    """
    from pardist.launch import _ports

    start = time.monotonic()

    def watch() -> None:
        lost_since, started = None, False
        while True:
            time.sleep(interval)
            started = started or bool(_children())
            if not started and time.monotonic() - start > patience + JOIN_GRACE_S:
                print(
                    f"{WHERE}: no worker started within --join-timeout={patience:.0f} s: this "
                    f"node could not join the rendezvous at {host}:{port}. If another job "
                    "holds that endpoint, give this job another port (the same on every "
                    "node), or use --standalone on one machine. Stopping this node.",
                    file=sys.stderr,
                    flush=True,
                )
                _stop_node()
            if _ports.listening(host, port, timeout=interval):
                lost_since = None
            elif lost_since is None:
                lost_since = time.monotonic()
            elif time.monotonic() - lost_since > patience:
                print(
                    f"{WHERE}: the rendezvous store at {host}:{port} has not answered for "
                    f"{patience:.0f} s (--join-timeout): the node that hosts it is lost. "
                    "Stopping this node's workers.",
                    file=sys.stderr,
                    flush=True,
                )
                _stop_node()

    threading.Thread(target=watch, daemon=True, name="pardist-launch-watch").start()


def _explain(exc: BaseException, join_timeout: int) -> str:
    """The end of a failed job's report, after torchrun's own (for errors that are not a rank's)."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    if isinstance(exc, RendezvousTimeoutError):
        return (
            f"{WHERE}: the job failed: not every node joined within --join-timeout="
            f"{join_timeout} s (a node failed, or was never started). This node's workers "
            "have exited."
        )
    return f"{WHERE}: the job failed: {type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``python -m pardist.launch [options] script.py args...``; exits non-zero on failure."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from pardist.launch._ports import PortInUseError

    try:
        args, env = prepare(sys.argv[1:] if argv is None else argv)
    except PortInUseError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    if args.keep_going:
        from pardist.launch import _keep

        raise SystemExit(_keep.run(args, env))
    os.environ.update(env)  # the agent reads them, and its workers inherit them
    os.environ["PARDIST_LAUNCHER_PID"] = str(os.getpid())  # ranks die with it (_process)
    host, port = _split_endpoint(args.rdzv_endpoint, 29400)
    if args.rdzv_backend == "c10d" and port != 0 and sys.platform == "linux":
        _watch(host, port, patience=args.join_timeout)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from pardist.launch import _failures, _rendezvous
    from pardist.transport import _segments

    try:
        config, cmd, cmd_args = config_from_args(args)  # torch's run(), with our stores
        config.rdzv_backend = _rendezvous.register(config.rdzv_backend)
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except (KeyboardInterrupt, SignalException) as exc:  # Ctrl-C, kill: 128 + the signal
        signum = getattr(exc, "sigval", signal.SIGINT)
        print(f"{WHERE}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        raise SystemExit(128 + int(signum)) from None
    except ChildFailedError as exc:  # a rank failed: say which, and why, in one line
        line, code = _failures.explain(exc, WHERE)
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(code) from None
    except Exception as exc:  # noqa: BLE001 - report, then fail like torchrun
        print(f"{exc}\n{_explain(exc, args.join_timeout)}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        _segments.clean_stale()  # left by workers killed while setting one up
