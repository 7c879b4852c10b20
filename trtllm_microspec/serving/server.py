"""`microspec serve`: the real tritonserver (from the nvidia-pytriton wheel) over a MicroSpec model repository.

The repository is `triton_repo/` (pass --model-repository) or one written from the command line's knobs. The wheel's
server needs its Python backend next to a stub built for this python, this python's own libpython first in
LD_LIBRARY_PATH (else the stub may bind the system one) and this python first in PATH. Its stub was built against
numpy 1 (pybind11 reads numpy 1's dtype layout): under numpy 2 every tensor it hands over or takes back has a zero
item size, so BYTES inputs read as one repeated byte and outputs arrive empty. Where this python has numpy 2 the
stub gets a numpy<2 of its own, first on its PYTHONPATH (the "stub site"; torch runs fine on either).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from ..models.registry import UserError

MODEL_NAME = "microspec"
SERVE_INSTALL = "pip install 'tritonclient[grpc]' && pip install --no-deps nvidia-pytriton==0.7.0"
STOP_FILE_ENV = "MICROSPEC_STOP_FILE"  # the model ends its requests once this file exists (see triton_model)
STUB_SITE = Path(sys.prefix) / "triton-stub-site"  # default home of the stub's numpy<2
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding trtllm_microspec, for the stub's sys.path

MODEL_PY = '''"""Triton Python-backend entry point; the model lives in trtllm_microspec/serving/triton_model.py."""
import os
import sys

# The stub runs python isolated, so PYTHONPATH is not on sys.path: put it first, before anything imports numpy
# (`microspec serve` puts the package and the stub's numpy<2 there).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

from trtllm_microspec.serving.triton_model import TritonPythonModel  # noqa: E402, F401
'''

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0  # Triton does not batch: the model feeds every request into its own running batch
model_transaction_policy {{ decoupled: true }}  # several responses per request: streaming over gRPC

input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "chat" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }},
  {{ name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "random_seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true }},
  {{ name: "speculate" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "num_input_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "num_output_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "num_cached_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "acceptance_length" data_type: TYPE_FP32 dims: [ 1 ] }},
  {{ name: "mean_active_vocab" data_type: TYPE_FP32 dims: [ 1 ] }}
]
instance_group [ {{ count: 1 kind: {kind}{gpus} }} ]
# requests wait in Triton's queue while every engine is full (the model's execute returns only while its engine has
# room); beyond max_queue_size Triton itself refuses them as UNAVAILABLE, which its HTTP generate answers with 503
dynamic_batching {{ default_queue_policy {{ max_queue_size: {queue} }} }}
{parameters}
"""


def model_params(a: argparse.Namespace) -> dict[str, str]:
    """The model's knobs as config.pbtxt parameters (all strings; empty = the engine's default)."""
    # the tree's knobs left unset: "", the tree of the device the model loads on (speculative.tree.tree_for)
    tree = {k: "" if getattr(a, k) is None else str(getattr(a, k)) for k in ("depth", "top_k", "total_tokens")}
    return {"engine_dir": str(a.engine), "draft_dir": str(a.draft or ""), "method": a.method,
            "device": a.device or "", "w_max": str(a.w_max), "k_pre": str(a.k_pre), "k_ver": str(a.k_ver),
            "k_tree": "" if a.k_tree is None else str(a.k_tree), "static_k": str(a.static_k), **tree, "max_seq_len": str(a.max_seq_len or ""),
            "dtype": a.dtype or "",
            "cuda_graphs": str(not a.eager).lower(), "max_batch": "" if a.max_batch is None else str(a.max_batch),
            "max_num_tokens": "" if a.max_num_tokens is None else str(a.max_num_tokens),
            "kv_memory": "" if a.kv_memory is None else str(a.kv_memory), "tp": str(a.tp),
            "tp_timeout": str(a.tp_timeout), "spec_policy": getattr(a, "spec_policy", "auto"),
            "overlap": "" if getattr(a, "overlap", None) is None else str(a.overlap).lower(),
            "prefix_cache": str(getattr(a, "prefix_cache", True)).lower()}


def check_queue_size(n: int) -> None:
    if n < 1:
        raise UserError(f"max_queue_size must be at least 1, got {n}")


def model_config(params: dict[str, str], kind: str = "cpu", name: str = MODEL_NAME,
                 gpus: list[int] | None = None, queue: int = 64) -> str:
    """gpus: one instance (one engine) on each of these GPUs; None: Triton's default for the kind (a gpu instance
    on every visible GPU). queue: most requests waiting in Triton's queue while the engines are full."""
    lines = "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    gpus_field = f" gpus: [ {', '.join(map(str, gpus))} ]" if gpus else ""
    return CONFIG.format(name=name, kind=f"KIND_{kind.upper()}", gpus=gpus_field, parameters=lines, queue=queue)


def write_repository(out: Path, params: dict[str, str], kind: str = "cpu", name: str = MODEL_NAME,
                     gpus: list[int] | None = None, queue: int = 64) -> Path:
    (out / name / "1").mkdir(parents=True, exist_ok=True)
    (out / name / "config.pbtxt").write_text(model_config(params, kind, name, gpus=gpus, queue=queue))
    (out / name / "1" / "model.py").write_text(MODEL_PY)
    return out


def pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")  # located, not imported: pytriton itself wants numpy<2
    if spec is None or importlib.util.find_spec("tritonclient") is None:
        raise UserError(f"the serve extra is not installed: {SERVE_INSTALL}")
    return Path(spec.submodule_search_locations[0])


def stub_site(path: Path | None) -> Path | None:
    """The folder with numpy<2 for the stub, or None when this python's numpy is already <2."""
    if int(importlib.metadata.version("numpy").split(".")[0]) < 2:
        return None
    path = Path(path or STUB_SITE)
    if not (path / "numpy").is_dir():
        raise UserError(f"tritonserver's Python stub needs numpy<2 and this python has numpy 2: "
                        f"pip install --no-deps --target {path} 'numpy<2' (or pass --stub-site DIR)")
    return path


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent: int):
    """A preexec_fn: the child gets SIGKILL when `parent` (the thread that started it) dies, even by SIGKILL,
    so that no tritonserver or follower outlives `microspec serve`. The parent may die between fork and prctl:
    then the child is already an orphan and exits at once."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def reap_leftovers() -> list[str]:
    """Temporary folders and /dev/shm regions of servers whose `microspec serve` is no longer running (killed
    before it could clean up); each name carries the pid of the serve that made it. Returns what it removed."""
    removed = []
    tmp = Path(tempfile.gettempdir())
    for path in [*tmp.glob("microspec-serve-*"), *tmp.glob("microspec-repo-*"), *Path("/dev/shm").glob("microspec_*")]:
        pid = path.name.replace("-", "_").split("_")[2 if path.parent == tmp else 1]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(str(path))
    return removed


def stub_pids(server_pid: int) -> list[int]:
    """The Python stubs (one per model instance) that tritonserver `server_pid` started."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv0 = (p / "cmdline").read_bytes().split(b"\0", 1)[0]
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and argv0.endswith(b"triton_python_backend_stub"):
            pids.append(int(p.name))
    return pids


def running(pid: int) -> bool:
    """False once the process is gone or a zombie (dead, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class TritonServer:
    """One tritonserver process: `with TritonServer(repo, ...) as s: s.wait_ready()`; leaving stops it and
    removes its stubs, shared-memory regions and temporary files. `kill` + `start` restarts it on the same ports."""

    def __init__(self, repo: Path, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, exit_timeout: int = 5, log_file: Path | None = None,
                 stub_site_dir: Path | None = None):
        self.repo, self.host = Path(repo).resolve(), host
        self.stub_site = stub_site(stub_site_dir)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.check_ports()
        self.exit_timeout = exit_timeout
        # the pid in the names lets a later start reap them if this process is killed before it cleans up
        self.workdir = Path(tempfile.mkdtemp(prefix=f"microspec-serve-{os.getpid()}-"))
        self.log_file = Path(log_file) if log_file else self.workdir / "tritonserver.log"
        self.shm_prefix = f"microspec_{os.getpid()}_{grpc_port}_"
        self.stop_file = self.workdir / "stopping"
        self.proc: subprocess.Popen | None = None

    def check_ports(self) -> None:
        for port in (self.http_port, self.grpc_port, self.metrics_port):  # else another server's answers look ours
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a listener fails it, TIME_WAIT not
                try:
                    probe.bind((self.host, port))
                except OSError:
                    raise UserError(f"port {port} on {self.host} is in use (another server?): choose other ports "
                                    f"with --http-port / --grpc-port / --metrics-port") from None

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def start(self) -> TritonServer:
        pt = pytriton_dir()
        server = pt / "tritonserver"
        backend = self.workdir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)  # a restart reuses it
        stub = server / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
        for f in (server / "backends" / "python" / "libtriton_python.so",
                  server / "backends" / "python" / "triton_python_backend_utils.py",
                  stub / "triton_python_backend_stub"):
            if not (backend / f.name).exists():  # a restart finds them there (a dying stub may still hold its file)
                shutil.copy(f, backend)
        env = dict(os.environ)
        extend = lambda var, *first: os.pathsep.join([*map(str, first), *filter(None, [env.get(var)])])  # noqa: E731
        env["LD_LIBRARY_PATH"] = extend("LD_LIBRARY_PATH", sysconfig.get_config_var("LIBDIR"),
                                        pt.parent / "nvidia_pytriton.libs")
        env["PATH"] = extend("PATH", Path(sys.executable).parent)
        env[STOP_FILE_ENV] = str(self.stop_file)
        env["PYTHONPATH"] = extend("PYTHONPATH", *filter(None, [self.stub_site]), PACKAGE_ROOT)
        cmd = [str(server / "bin" / "tritonserver"), f"--model-repository={self.repo}",
               f"--backend-directory={self.workdir / 'backends'}",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
               "--allow-gpu-metrics=false", f"--exit-timeout-secs={self.exit_timeout}"]
        log = open(self.log_file, "ab")
        # its own session: a Ctrl-C at the terminal reaches us only, and we stop the server and its stubs in order;
        # it dies with us even on SIGKILL, and its stubs exit when it dies (they watch their parent)
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with(os.getpid()))
        log.close()
        return self

    def wait_ready(self, model: str = MODEL_NAME, timeout: float = 600) -> None:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        from .client import FAST_RECONNECT

        # made before the server listens: with gRPC's growing backoff a restart's readiness was seen seconds late
        # (test_faults: serve said "ready again" over 5 s after a client had been answered)
        client = grpcclient.InferenceServerClient(self.grpc_url, channel_args=FAST_RECONNECT)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise UserError(f"tritonserver exited with code {self.proc.returncode} before {model} was "
                                    f"ready: {self.log_errors()}")
                try:
                    if client.is_model_ready(model):
                        return
                except InferenceServerException:
                    pass  # not listening yet
                time.sleep(0.2)
        finally:
            client.close()
        raise UserError(f"{model} was not ready after {timeout:.0f} s (log: {self.log_file})")

    def log_errors(self) -> str:
        """The server log's error lines (glog `E...` lines and the model's exception), for a one-line message."""
        lines = self.log_file.read_text(errors="replace").splitlines()
        errors = [ln.split("] ", 1)[-1].split("\\n", 1)[0] for ln in lines  # the message, not the traceback
                  if ln[:1] == "E" and ln[1:5].isdigit() and "CudaDriverHelper" not in ln]  # no GPU: not an error
        return " | ".join(errors[-3:]) or f"see {self.log_file}"

    def stop(self) -> int | None:
        """Graceful stop: in-flight and queued requests end with an error, the model unloads and the server exits;
        whatever is left after exit_timeout (+ a grace period) is killed."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop_file.touch()
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(self.exit_timeout + 10)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also after a second Ctrl-C: then this is the forced stop
            rc = self.kill()
            shutil.rmtree(self.workdir, ignore_errors=True)
        return rc

    def kill(self) -> int | None:
        """Ends the server and every stub at once (SIGKILL): its clients' connections close, so each request in
        flight ends with an error. Removes its shared-memory regions; the workdir stays for a restart."""
        rc = self.proc.poll() if self.proc is not None else None
        if self.proc is not None:
            try:  # the server and any stub it left behind share the process group we started
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for f in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            f.unlink(missing_ok=True)
        return rc

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_gpus(text: str | None, tp: int) -> list[int] | None:
    """--gpus 0,1 -> [0, 1]: one engine instance per GPU (data parallel)."""
    if not text:
        return None
    if tp > 1:
        raise UserError("--gpus and --tp > 1 together are not supported: the tensor-parallel instance uses GPUs "
                        "0 .. tp-1")
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        raise UserError(f"--gpus takes GPU ids separated by commas, e.g. 0,1; got {text!r}") from None
    if len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise UserError(f"--gpus takes distinct GPU ids, each at least 0; got {text!r}")
    return gpus


class Followers:
    """`serve --tp N`: ranks 1 .. N-1 (serving/tp.py), started beside the server; they end with it. `check` turns a
    follower that died into a one-line error with the last line it wrote."""

    def __init__(self, a: argparse.Namespace, port: int | None, log_file: Path):
        self.a, self.port, self.log_file, self.procs = a, port, log_file, []

    def __enter__(self) -> Followers:
        if self.port is None:
            return self
        with open(self.log_file, "ab") as log:
            for r in range(1, self.a.tp):
                cmd = [sys.executable, "-m", "trtllm_microspec.serving.tp", "--rank", str(r), "--tp", str(self.a.tp),
                       "--port", str(self.port), "--device", self.a.device or "", "--tp-timeout",
                       str(self.a.tp_timeout)]
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                                   preexec_fn=die_with(os.getpid())))
        return self

    def check(self) -> None:
        for r, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                last = (self.log_file.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise UserError(f"tensor-parallel rank {r} exited with code {p.returncode}: {last}")

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            try:
                p.wait(5)  # the model's finalize has told it to exit
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def openai_front(host: str, port: int | None):
    """serve --openai-port: the OpenAI endpoint (serving/openai_api.py), bound now; without it, nothing."""
    if port is None:
        return contextlib.nullcontext()
    from .openai_api import OpenAIFront

    return OpenAIFront(host, port)


_signals: list[str] = []  # the shutdown signals received so far


def _shutting_down(signum, _frame) -> None:
    """SIGTERM and Ctrl-C unwind alike: the server, the followers and the OpenAI front are stopped on the way out
    (the `with` blocks, in that order); a second one during that stop forces it (TritonServer.stop)."""
    name = signal.Signals(signum).name
    log(f"{name}, shutting down" if not _signals else f"{name} again, stopping at once")
    _signals.append(name)
    raise KeyboardInterrupt


def log(message: str) -> None:
    print(f"microspec serve: {message}", file=sys.stderr, flush=True)


class Supervisor:
    """Watches a ready tritonserver and its model's stubs (the model's processes). A stub that dies (a CUDA fault,
    an OOM kill, a segfault) leaves Triton reporting the model ready while every request sent to it fails and the
    ones in flight never get another response (measured with tritonserver 2.51: unloading the model does not end
    them either). So the server is killed at once: its probes stop answering (not ready), and every connection, with
    each request in flight or queued on it, ends with an error (gRPC UNAVAILABLE). Then, on_failure "restart": the
    server starts again on the same ports and serves once the model is loaded; "exit": serve exits with an error
    (for supervisors that restart the whole process). tritonserver itself crashing (a signal such as SIGSEGV: its
    HTTP generate endpoint segfaults on a body over ~4 MB, triton-inference-server/server#5840) is handled the same
    way; tritonserver exiting otherwise ends serve with an error."""

    POLL_S = 0.2
    CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL}

    def __init__(self, server: TritonServer, on_failure: str = "restart", ready_timeout: float = 600,
                 checks: tuple = ()):
        self.server, self.on_failure, self.ready_timeout, self.checks = server, on_failure, ready_timeout, checks
        self.restarts = 0

    def wait_ready(self) -> list[int]:
        self.server.wait_ready(timeout=self.ready_timeout)
        stubs = stub_pids(self.server.proc.pid)
        if not stubs:
            raise UserError(f"tritonserver reports {MODEL_NAME} ready but runs no Python stub: see "
                            f"{self.server.log_file}")
        return stubs

    def run(self, stubs: list[int]) -> None:
        """Until Ctrl-C / SIGTERM (KeyboardInterrupt) or a failure that ends serve (UserError)."""
        while True:
            if (rc := self.server.proc.poll()) is not None:
                if -rc not in self.CRASHES:
                    raise UserError(f"tritonserver exited with code {rc}: {self.server.log_errors()}")
                stubs = self.failed(f"tritonserver (pid {self.server.proc.pid}) crashed with "
                                    f"{signal.Signals(-rc).name}")
            for check in self.checks:
                check()
            dead = [pid for pid in stubs if not running(pid)]
            if dead:
                stubs = self.failed(f"the model's process (pid {dead[0]}) died")
            time.sleep(self.POLL_S)

    def failed(self, what: str) -> list[int]:
        """Ends what is left of the server (it is not ready then), then restarts it or ends serve."""
        t0 = time.monotonic()
        self.server.kill()
        log(f"{what}; tritonserver stopped, so it is not ready and every request in flight or queued ended with "
            f"an error")
        if self.on_failure == "exit":
            raise UserError(f"{what} (--on-model-failure exit)")
        self.restarts += 1
        log(f"restarting tritonserver (restart {self.restarts})")
        self.server.check_ports()
        self.server.start()
        stubs = self.wait_ready()
        log(f"{MODEL_NAME} ready again in {time.monotonic() - t0:.1f} s")
        return stubs


def cmd_serve(a: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, _shutting_down)
    signal.signal(signal.SIGINT, _shutting_down)  # also when started in the background of a script
    try:
        _serve(a)
    except KeyboardInterrupt:
        print("microspec serve: stopped", file=sys.stderr, flush=True)


def _serve(a: argparse.Namespace) -> None:
    pytriton_dir()  # fail early and clearly without the serve extra
    stub_site(a.stub_site)
    check_queue_size(a.max_queue_size)
    # the pid in the name: a later start reaps it if this process is killed
    with tempfile.TemporaryDirectory(prefix=f"microspec-repo-{os.getpid()}-") as tmp:
        repo = Path(a.model_repository) if a.model_repository else None
        port = None  # of the tensor-parallel group's store (--tp > 1)
        if repo is None:
            from ..cli import resolve_tree
            from ..engine.loader import read_config
            from ..llm import DRAFT_SUBDIR, check_knobs, k_tree_for, resolve_engine

            a.engine = resolve_engine(a.engine).resolve()  # builds a model key's engine here, not in the stub
            resolve_tree(a, "cuda" if a.gpus else None)  # the tree of the device the model will run on
            # bad knobs fail here in one line, not later as a model that will not load inside the server
            check_knobs(read_config(a.engine).vocab_size, a.w_max, a.k_pre, a.k_ver, a.static_k, a.depth, a.top_k,
                        a.total_tokens, a.max_seq_len, a.tp, a.tp_timeout, a.max_batch, a.kv_memory,
                        a.max_num_tokens, k_tree_for(a.method, a.k_tree))
            draft = Path(a.draft) if a.draft else a.engine / DRAFT_SUBDIR
            if a.method != "ar" and not draft.exists():
                raise UserError(f"method {a.method} needs a draft head: pass --draft DIR (none at {draft})")
            a.draft = draft.resolve() if a.draft else None
            gpus = parse_gpus(a.gpus, a.tp)
            kind = a.instance_kind or ("gpu" if gpus or (a.device or "").startswith("cuda") else "cpu")
            params = model_params(a)
            if a.tp > 1:  # this process hosts the group's store: the model (rank 0) and the followers join it
                import torch.distributed as dist

                store = dist.TCPStore("127.0.0.1", 0, a.tp, True, wait_for_workers=False)
                port = store.port
                params["tp_port"] = str(port)
                gpus = [0] if kind == "gpu" else None  # one instance, rank 0 on GPU 0; followers on 1 .. tp-1
            repo = write_repository(Path(tmp), params, kind, gpus=gpus, queue=a.max_queue_size)
        elif not (repo / MODEL_NAME / "config.pbtxt").exists():
            raise UserError(f"{repo} has no {MODEL_NAME}/config.pbtxt")
        # after the checks: bad input is one line on stderr, nothing before it
        for path in reap_leftovers():
            log(f"removed {path}, left by a server that is no longer running")
        # the OpenAI front binds its port now (a busy one fails before the model loads) and stops last, after the
        # server has ended its requests with an error it forwards
        front = openai_front(a.host, a.openai_port)
        # a restarted model would have no followers to join: under --tp a dead model ends serve
        on_failure = "exit" if a.tp > 1 else a.on_model_failure
        # the followers outlive the server: it stops first, and its model tells them to exit
        with front, Followers(a, port, Path(tmp) / "tp-followers.log") as followers, \
                TritonServer(repo, a.host, a.http_port, a.grpc_port, a.metrics_port, a.exit_timeout, a.log_file,
                             a.stub_site) as server:
            print(f"starting tritonserver on {repo} (log: {server.log_file})", file=sys.stderr)
            t0 = time.monotonic()
            supervisor = Supervisor(server, on_failure, a.ready_timeout, checks=(followers.check,))
            stubs = supervisor.wait_ready()
            openai = ""
            if a.openai_port is not None:
                openai = f"  OpenAI   {front.start(server.grpc_url).url}  (models, completions, chat/completions)\n"
            print(f"{MODEL_NAME} ready in {time.monotonic() - t0:.1f} s\n"
                  f"  gRPC     {server.grpc_url}  (streaming: microspec client --url {server.grpc_url})\n"
                  f"  HTTP     POST http://{a.host}:{a.http_port}/v2/models/{MODEL_NAME}/generate (JSON) and "
                  f".../generate_stream (server-sent events)\n"
                  f"  metrics  http://{a.host}:{a.metrics_port}/metrics\n"
                  f"{openai}Ctrl-C to stop.", flush=True)
            supervisor.run(stubs)


def register(sub) -> None:
    from ..cli import add_batch_args, add_llm_args

    p = sub.add_parser("serve", help="serve MicroSpec through a real Triton Inference Server (gRPC streaming, HTTP "
                       "generate)")
    add_llm_args(p)
    add_batch_args(p)
    p.set_defaults(method="microspec", func=cmd_serve)
    p.add_argument("--model-repository", help="serve this repository as it is (e.g. triton_repo) instead of "
                   "writing one from the options above")
    p.add_argument("--instance-kind", choices=["cpu", "gpu"], help="Triton instance kind (default: gpu for a cuda "
                   "device, else cpu); a gpu instance runs on the device Triton gives it")
    p.add_argument("--max-queue-size", type=int, default=64, help="most requests waiting in Triton's queue "
                   "while the engine is full; more are refused as UNAVAILABLE (HTTP 503)")
    p.add_argument("--gpus", help="GPU ids, e.g. 0,1: one engine instance on each (data parallel: concurrent "
                   "requests spread over them); default: one instance")
    p.add_argument("--host", default="127.0.0.1", help="address the endpoints listen on")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    o = p.add_argument_group("openai", "an OpenAI-compatible endpoint beside Triton's, forwarding to the same model "
                             "(the same running batch, queue and metrics): serving/openai_api.py")
    o.add_argument("--openai-port", type=int, help="serve GET /v1/models, POST /v1/completions and "
                   "/v1/chat/completions (streamed or not) on this port, on --host; default: off")
    p.add_argument("--exit-timeout", type=int, default=5, help="seconds in-flight requests get at shutdown")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for the model to load")
    p.add_argument("--on-model-failure", choices=["restart", "exit"], default="restart", help="when the model's "
                   "process dies: restart tritonserver and serve again, or exit with an error (for a supervisor "
                   "that restarts the whole process); either way the requests in flight end with an error at once "
                   "(under --tp: exit)")
    p.add_argument("--log-file", help="tritonserver's log (default: a temporary file, removed at exit)")
    p.add_argument("--stub-site", help=f"folder holding numpy<2 for Triton's Python stub (default: {STUB_SITE})")

