"""Generators shipped as pip packages (`generator.model=smollm2`): a GGUF file, dequantised once to a cached HF folder.

transformers reads the GGUF (`from_pretrained(pkg_dir, gguf_file=...)`, with the `gguf` package) and dequantises it
to a trainable fp32 model; that takes ~14 s for SmolLM2-135M on 2 cores, a saved HF folder loads in ~0.2 s. So the
first load saves the dequantised model and its tokenizer under `<cache>/<model>-<sha256 of the gguf file>` and every
later load (each Ray worker, each run) reads that folder. The cache is `$RAGTRAIN_CACHE` or `~/.cache/ragtrain`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

from ragtrain.config.generator import PACKAGED, PackagedModel
from ragtrain.runtime.console import get_logger
from ragtrain.runtime.errors import ConfigError

log = get_logger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("RAGTRAIN_CACHE") or Path.home() / ".cache" / "ragtrain")


def package_dir(p: PackagedModel) -> Path:
    """The installed package's folder, found without importing it (its import needs dependencies we skip)."""
    spec = importlib.util.find_spec(p.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"generator.model needs the package {p.requirement}: run `{p.install_command()}`")
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def _sha256(path: Path) -> str:
    with path.open("rb") as f:  # ~0.15 s for 98 MB; once per process
        return hashlib.file_digest(f, "sha256").hexdigest()


def packaged_folder(name: str) -> str:
    """The HF folder of packaged model `name` (PACKAGED), dequantised from its GGUF file on first use."""
    p = PACKAGED[name]
    gone = p.missing()
    if gone:
        raise ConfigError(f"generator.model={name} needs {gone}, which are not installed: run `{p.install_command()}`")
    gguf = package_dir(p) / p.gguf_file
    if not gguf.exists():
        raise ConfigError(f"generator.model={name}: the package has no {p.gguf_file} (reinstall {p.requirement})")
    folder = cache_root() / f"{name}-{_sha256(gguf)[:16]}"
    if not (folder / "config.json").exists():
        _dequantise(gguf, folder)
    if not (folder / "README.md").exists():  # (folders dequantised before cards were written get one now)
        try:
            write_card(gguf, p, folder)
        except OSError as e:  # a read-only shared cache still serves the model; its export declares no license
            log.warning(f"[generator] could not write the model card of {folder}: {e}")
    return str(folder)


def gguf_metadata(gguf: Path) -> dict[str, str]:
    """The GGUF file's `general.*` string fields (name, organization, license, ...), read from its header."""
    from gguf import GGUFReader, GGUFValueType  # lazy: installed with the packaged model

    out = {}
    for key, f in GGUFReader(str(gguf)).fields.items():
        if key.startswith("general.") and f.types == [GGUFValueType.STRING]:
            out[key.removeprefix("general.")] = bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
    return out


def write_card(gguf: Path, p: PackagedModel, folder: Path) -> None:
    """README.md of the dequantised folder: what it was made from and the license the GGUF declares (the card an
    export of a model fine-tuned from it carries the license over from)."""
    meta = gguf_metadata(gguf)
    license_ = meta.get("license")
    card = (
        "---\nlibrary_name: transformers\npipeline_tag: text-generation\n"
        + (f"license: {json.dumps(license_)}\n" if license_ else "")  # quoted: a license is free text
        + f"---\n# {gguf.stem}, dequantised to fp32\n\n{meta.get('name', gguf.stem)}"
        + (f" by {meta['organization']}" if "organization" in meta else "")
        + f": dequantised by ragtrain from `{gguf.name}` of the `{p.requirement}` package"
        + (f"; its declared license: {license_}.\n" if license_ else "; it declares no license.\n")
    )
    tmp = folder / f"README.md.{socket.gethostname()}.{os.getpid()}"  # atomic: workers of nodes sharing it race
    tmp.write_text(card, encoding="utf-8")
    tmp.replace(folder / "README.md")


def _dequantise(gguf: Path, folder: Path) -> None:
    """Load the GGUF (dequantised to fp32) and save model + tokenizer to `folder`, atomically: workers on one node
    may race here, and a half-written folder must never look complete."""
    # lazy: transformers is heavy (~1 s); this module imports without it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info(f"[generator] dequantising {gguf.name} into {folder} (once per machine)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain fp32 tensors now; the GGUF quantizer marker only makes save_pretrained refuse them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first: its folder is as good as ours
            if not (folder / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
