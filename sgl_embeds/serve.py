"""``python -m sgl_embeds serve CHECKPOINT [--dry-run] [SGLang flags...]``: serve with the plugin.

``plan`` reads the checkpoint's ``config.json`` and takes its family's way: a LLaVA checkpoint is
split once into the split cache (``split_dir``) and its LLM served; a Qwen-VL one is served
natively; a text LLM as it is; anything else is an error naming the families served. ``main``
prints the ``sglang.launch_server`` line (the machine's flags, then yours, which override) and
execs it, or with ``--dry-run`` only prints it; ``launch`` runs it as a child (``Served``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable
from importlib.metadata import entry_points
from pathlib import Path

import blake3
import requests
import torch
from tqdm import tqdm

from sgl_embeds.vlm.checkpoint import SPLIT_VERSION, sglang_serves, split
from sgl_embeds_protocol.family import ENCODER_DECODER, NATIVE, REFUSED, SPLIT, family_of, served_titles
from sgl_embeds_protocol.environment import setting
from sgl_embeds_protocol.wire import TENANTS_VAR

# On CPU SGLang sizes the KV pool to ~85% of free RAM; two servers would exhaust the machine.
# A fixed pool (in tokens) is ample for tests and the demo; a later flag overrides it.
CPU_KV_TOKENS = 16384


def on_cpu() -> bool:
    """CPU unless a CUDA device is usable."""
    return not torch.cuda.is_available()


def cpu_launch_args(dtype: str = "float32") -> list[str]:
    """SGLang on CPU: torch-native attention, no CUDA graph, no overlap schedule, and
    ``--sleep-on-idle`` (without it the idle scheduler busy-loops a core)."""
    return [
        "--device", "cpu", "--attention-backend", "torch_native",
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        "--disable-overlap-schedule", "--dtype", dtype, "--sleep-on-idle",
        "--max-total-tokens", str(CPU_KV_TOKENS),
    ]


# SGLang on CPU, and the opt-in of the CPU kernels (sgl_embeds_cpu.plugin.OPT_IN) in each of its
# processes: the pure-torch sgl_kernel stand-ins and the CPU-only hooks
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_EMBEDS_CPU_KERNELS": "1"}


def machine_args() -> list[str]:
    """The launch flags of this machine: the CPU defaults (float32: bfloat16 matrix work is several
    times slower on CPUs without AVX512_BF16), or none on a GPU (SGLang picks)."""
    return cpu_launch_args() if on_cpu() else []


def family_args(native_vlm: bool) -> list[str]:
    """The flags a natively served VLM needs: SGLang's multimodal path, and on CPU the vision
    tower's attention in sdpa (its default kernels are CUDA's)."""
    if not native_vlm:
        return []
    return ["--enable-multimodal", *(["--mm-attention-backend", "sdpa"] if on_cpu() else [])]


# The variable SGLang reads the dtype of a hybrid model's conv state from (bfloat16 by default)
CONV_DTYPE_VAR = "SGLANG_MAMBA_CONV_DTYPE"


def hybrid_env(args: list[str]) -> dict[str, str]:
    """A hybrid (Gated DeltaNet) model served in float32 keeps its conv state in float32 too, as
    HF does: SGLang's bfloat16 default moved its logprobs by 9.4e-3 on the tiny Qwen3.5 (2.9e-6 in
    float32). Empty for another dtype, or where the caller's environment says."""
    dtype = None  # the last --dtype wins, as in SGLang's argument parser
    for i, arg in enumerate(args):
        if arg == "--dtype" and i + 1 < len(args):
            dtype = args[i + 1]
        elif arg.startswith("--dtype="):
            dtype = arg.split("=", 1)[1]
    if dtype in ("float32", "float") and CONV_DTYPE_VAR not in os.environ:
        return {CONV_DTYPE_VAR: "float32"}
    return {}


@dataclass(frozen=True)
class ConfigFix:
    """A field of a checkpoint's config.json that SGLang reads and the checkpoint lacks."""

    section: str  # "text_config" or "vision_config"
    field: str
    value: object
    why: str


def hybrid_config_fixes(config: dict) -> list[ConfigFix]:
    """What a hybrid Qwen3.5 checkpoint saved by transformers lacks that SGLang reads (published
    checkpoints carry both): ``deepstack_visual_indexes`` (transformers' Qwen3.5 tower has no
    deepstack layers; SGLang would assume Qwen3-VL's three and fail on the first image) and
    ``full_attention_interval`` (from ``layer_types``, where every k-th layer is full attention;
    ``ServeError`` where it is not)."""
    fixes = []
    if "deepstack_visual_indexes" not in config.get("vision_config", {}):
        fixes.append(ConfigFix("vision_config", "deepstack_visual_indexes", [],
                               "the tower has no deepstack layers (SGLang would assume three)"))
    text = config.get("text_config", {})
    if "full_attention_interval" not in text:
        types = text.get("layer_types") or []
        full = [i for i, kind in enumerate(types) if kind == "full_attention"]
        every = full[0] + 1 if full else 0
        if not full or full != list(range(every - 1, len(types), every)):
            raise ServeError(f"text_config has no full_attention_interval, and its layer_types {types} "
                             "are not full attention at every k-th layer: SGLang cannot serve that layout")
        fixes.append(ConfigFix("text_config", "full_attention_interval", every,
                               f"layer_types has full attention at every {every}th layer"))
    return fixes


def with_config_fixes(checkpoint: Path, config: dict, fixes: list[ConfigFix], make: bool = True) -> Path:
    """``checkpoint`` itself where nothing needs fixing; else a folder in the cache that is the
    checkpoint with ``fixes`` written into its config.json (its other files linked, the user's
    files untouched), saying what it wrote."""
    if not fixes:
        return checkpoint
    fixed = json.loads(json.dumps(config))
    for fix in fixes:
        fixed.setdefault(fix.section, {})[fix.field] = fix.value
        print(f"[serve] {checkpoint}: config.json has no {fix.section}.{fix.field}; serving it as "
              f"{fix.value!r}: {fix.why}", flush=True)
    text = json.dumps(fixed, indent=2, sort_keys=True)
    key = hashlib.sha256(f"{checkpoint.resolve()}\n{text}".encode()).hexdigest()[:32]
    target = cache_root() / "configs" / key

    def build(folder: Path) -> None:
        for entry in checkpoint.resolve().iterdir():
            if entry.name != "config.json":
                (folder / entry.name).symlink_to(entry.resolve())
        (folder / "config.json").write_text(text)

    if make:
        build_once(target, build)
        print(f"[serve] the checkpoint with that config.json (its files linked): {target}", flush=True)
    return target


@dataclass(frozen=True)
class Launch:
    """What ``serve`` runs: the served folder, SGLang's arguments, the environment it adds."""

    family: str | None  # None: a text LLM
    model_dir: Path
    args: list[str]
    env: dict[str, str]

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                *self.args]

    def command_line(self) -> str:
        """The line to paste into a shell."""
        return shlex.join([f"{k}={v}" for k, v in self.env.items()] + self.argv)


class ServeError(ValueError):
    """A checkpoint ``serve`` does not serve (the message is one line)."""


def plan(checkpoint: str | Path, flags: list[str], progress: bool = True,
         dry_run: bool = False) -> Launch:
    """The launch of ``checkpoint`` (splitting a LLaVA one first, once, unless ``dry_run``);
    ``ServeError`` for a family it does not serve."""
    flags, tenants_file = _tenants_flag(flags)
    checkpoint = checkpoint_folder(checkpoint, download=not dry_run)
    config_path = checkpoint / "config.json"
    if not config_path.exists():
        raise ServeError(f"{config_path} is missing: CHECKPOINT is an HF checkpoint folder or hub id")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    family = family_of(model_type)
    env = dict(CPU_ENV) if on_cpu() else {}
    if tenants_file is not None:
        env[TENANTS_VAR] = tenants_file
    served_as = family.served_as if family else None
    if served_as == SPLIT:
        llm = split_dir(checkpoint, progress, make=not dry_run) / "llm"
        return Launch(model_type, llm, [*machine_args(), *flags], env)
    if served_as == NATIVE:
        args = [*machine_args(), *family_args(True), *flags]
        if family.hybrid:
            env.update(hybrid_env(args))
            checkpoint = with_config_fixes(checkpoint, config, hybrid_config_fixes(config), make=not dry_run)
        return Launch(model_type, checkpoint, args, env)
    if served_as == ENCODER_DECODER:  # served whole; its tower and projector are the client's
        # SGLang's warm-up request has no image rows, which such a model refuses (a 400 that
        # would stop the launch)
        warmup = [] if SKIP_WARMUP in flags else [SKIP_WARMUP]
        return Launch(model_type, checkpoint, [*machine_args(), *warmup, *flags], env)
    arch = (config.get("architectures") or [""])[0]
    if family is None and arch.endswith("ForCausalLM") and sglang_serves(arch):
        return Launch(None, checkpoint, [*machine_args(), *flags], env)
    why = f": {family.refused}" if served_as == REFUSED else ""
    raise ServeError(f"{checkpoint}: model_type {model_type!r} ({arch or 'no architecture'}) is not "
                     f"served{why}; served: {served_titles()}")


def checkpoint_folder(checkpoint: str | Path, download: bool = True) -> Path:
    """``checkpoint`` as a folder: a folder as it is; a hub id (``org/name``, as
    ``sglang.launch_server`` takes) from the local Hugging Face cache, else downloaded (unless
    ``download`` is False or the hub is off: ``HF_HUB_OFFLINE``). ``ServeError`` naming what to do
    when neither has it."""
    path = Path(checkpoint)
    if path.exists() or len(path.parts) != 2 or str(checkpoint).startswith((".", "/", "~")):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo = str(checkpoint)
    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except LocalEntryNotFoundError:
        if not download:
            raise ServeError(f"{repo} is not a folder, nor in the local Hugging Face cache "
                             "(--dry-run downloads nothing)") from None
    try:
        print(f"[serve] downloading {repo} from the Hugging Face hub", flush=True)
        return Path(snapshot_download(repo))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ServeError(f"{repo} is not a folder, nor in the local Hugging Face cache, and could not "
                         f"be downloaded ({type(e).__name__}): run `hf download {repo}` where the hub "
                         "is reachable (or set HF_HUB_CACHE to a cache that has it), or pass the "
                         "checkpoint's folder") from None


def cache_root() -> Path:
    """``$SGLANG_EMBEDS_CACHE``, else ``$XDG_CACHE_HOME/sgl_embeds`` (``~/.cache/sgl_embeds``)."""
    root = setting("SGLANG_EMBEDS_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sgl_embeds"


def checkpoint_key(checkpoint: Path, progress: bool = True) -> str:
    """A BLAKE3 of every file of the checkpoint folder (names, sizes, bytes) and of the split's
    layout (``SPLIT_VERSION``), with a progress bar over the bytes; kept in the cache beside the
    files' names, sizes and modification times, so that a later launch of the unchanged folder
    reads no byte again (as ``make`` trusts times)."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(checkpoint).parts))
    signature = [SPLIT_VERSION] + [[p.relative_to(checkpoint).as_posix(), p.stat().st_size, p.stat().st_mtime_ns]
                                   for p in files]
    memo = cache_root() / "keys" / (hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:32] + ".json")
    try:
        known = json.loads(memo.read_text())
        if known["signature"] == signature:
            return known["key"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: hash
    key = _hash_files(checkpoint, files, progress)
    memo.parent.mkdir(parents=True, exist_ok=True)
    written = memo.with_name(memo.name + f".tmp{os.getpid()}")
    written.write_text(json.dumps({"signature": signature, "key": key}))
    written.replace(memo)
    return key


def _hash_files(checkpoint: Path, files: list[Path], progress: bool) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(f"split v{SPLIT_VERSION}\0".encode())
    with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True,
              desc="[serve] hashing the checkpoint", disable=not progress) as bar:
        for p in files:
            h.update(f"{p.relative_to(checkpoint).as_posix()}\0{p.stat().st_size}\0".encode())
            with open(p, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()[:32]


def split_dir(checkpoint: Path, progress: bool = True, make: bool = True) -> Path:
    """The split of ``checkpoint`` in the split cache (``llm/`` and ``vision/``), made on first
    use (unless ``make`` is False): into a temporary folder renamed when done, so an interrupted
    split is never reused."""
    target = cache_root() / "splits" / checkpoint_key(checkpoint, progress)
    if (target / "llm" / "config.json").exists() and (target / "vision").exists():
        print(f"[serve] split of {checkpoint} found: {target}", flush=True)
        return target
    if not make:
        print(f"[serve] {checkpoint} would be split into {target}", flush=True)
        return target
    build_once(target, lambda tmp: split(checkpoint, tmp), done="llm/config.json")
    print(f"[serve] split into {target}", flush=True)
    return target


def build_once(target: Path, build: Callable[[Path], None], done: str = "config.json") -> Path:
    """``target``, built by ``build(folder)`` into a temporary folder renamed when done, so an
    interrupted build is never reused; a target that holds ``done`` is not built again. Builds
    of one target take turns (a lock file beside it): a second waits, then finds it built; the
    temporary folders of a build that was killed are removed by the next."""
    if (target / done).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / done).exists():
            return target
        for stale in target.parent.glob(target.name + ".tmp*"):  # no other build runs now
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        tmp.mkdir()
        try:
            build(tmp)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


TENANTS_FLAG, SKIP_WARMUP = "--tenants", "--skip-server-warmup"


def _tenants_flag(flags: list[str]) -> tuple[list[str], str | None]:
    """``flags`` without ``--tenants FILE`` (serve's own flag: a JSON file of API key -> tenant,
    docs/reliability.md, "Tenants") and with ``--skip-server-warmup`` where it was given, and
    that file's absolute path (None without the flag)."""
    rest, path = [], None
    it = iter(flags)
    for flag in it:
        if flag == TENANTS_FLAG or flag.startswith(TENANTS_FLAG + "="):
            path = flag.partition("=")[2] if "=" in flag else next(it, None)
            if not path or not Path(path).is_file():
                raise ServeError(f"{TENANTS_FLAG} takes a JSON file of API key -> tenant, got {path!r}")
        else:
            rest.append(flag)
    if path is None:
        return rest, None
    if any(f == "--api-key" or f.startswith("--api-key=") for f in rest):
        raise ServeError(f"{TENANTS_FLAG} and --api-key both given: with tenants every tenant's key "
                         "is an API key; drop --api-key")
    if SKIP_WARMUP not in rest:  # SGLang's warm-up requests carry no tenant's key
        rest.append(SKIP_WARMUP)
    return rest, str(Path(path).resolve())


def plugin_installed() -> bool:
    return any(ep.name == "sgl_embeds" for ep in entry_points(group="sglang.srt.plugins"))


DRY_RUN = "--dry-run"


def main(argv: list[str]) -> int:
    """``serve CHECKPOINT [--dry-run] [--tenants FILE] [SGLang flags...]``: print the launch line, then run it
    (never returns unless it fails before the launch, or with ``--dry-run``). It becomes the
    launched process (``exec``: the same pid, so signals reach SGLang). ``--dry-run`` may stand
    anywhere after ``serve``: nothing is split or launched (a LLaVA checkpoint's line names the
    folder its split would be made in)."""
    dry_run = DRY_RUN in argv
    argv = [arg for arg in argv if arg != DRY_RUN]
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m sgl_embeds serve CHECKPOINT [--dry-run] [--tenants FILE] [SGLang flags...]\n\n{__doc__}")
        return 0 if argv else 2
    if not plugin_installed():
        print("error: the sgl_embeds plugin is not installed in this environment "
              "(no entry point sgl_embeds in group sglang.srt.plugins): pip install sgl_embeds",
              file=sys.stderr)
        return 2
    try:
        planned = plan(argv[0], argv[1:], progress=sys.stderr.isatty(), dry_run=dry_run)
    except (ServeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[serve] {planned.family or 'text LLM'}: {planned.command_line()}", flush=True)
    if dry_run:
        return 0
    os.execve(sys.executable, planned.argv, {**os.environ, **planned.env})


# launch: the first port from SGLang's default up that nothing listens on; how long a start may take
FIRST_PORT = 30000
START_TIMEOUT_S = 300.0
READY_LINE = "fired up and ready to roll"  # SGLang's log line once its warm-up request is done


@dataclass
class Served:
    """A server ``launch`` started: its ``url``, the ``command`` it runs, its ``log`` file."""

    url: str
    command: list[str]
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        """SIGTERM to the server (it drains, then stops its children), SIGKILL to what is left of
        its process group after 30 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(checkpoint: str | Path, *flags: str, port: int | None = None,
           timeout: float = START_TIMEOUT_S) -> Served:
    """Run ``python -m sgl_embeds serve CHECKPOINT --port PORT FLAGS`` as a child process (for a
    notebook or a script; in a shell, run the printed command), print that command and then the
    ``sglang.launch_server`` line serve runs, and return once the server answers. ``port``: the
    first free one from 30000 by default. ``RuntimeError`` with the end of the server's log if
    it exits or is not ready within ``timeout`` seconds (then it is stopped)."""
    port = port or next(p for p in range(FIRST_PORT, FIRST_PORT + 1000) if not _listening(p))
    command = [sys.executable, "-m", "sgl_embeds", "serve", str(checkpoint), "--host", "127.0.0.1",
               "--port", str(port), *flags]
    print(f"$ {shlex.join(command)}", flush=True)
    fd, name = tempfile.mkstemp(prefix=f"sgl_embeds-serve-{port}-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    served = Served(f"http://127.0.0.1:{port}", command, process, Path(name))
    try:
        _wait_ready(served, timeout)
    except BaseException:
        served.stop()
        raise
    print(next(line for line in served.log.read_text().splitlines() if line.startswith("[serve]")), flush=True)
    return served


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_ready(served: Served, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = served.log.read_text(errors="replace")
        if served.process.poll() is not None:
            raise RuntimeError(f"the server exited ({served.process.returncode}):\n{log[-3000:]}")
        try:
            if READY_LINE in log and requests.get(served.url + "/health", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s; its log ends:\n"
                       f"{served.log.read_text(errors='replace')[-3000:]}")
