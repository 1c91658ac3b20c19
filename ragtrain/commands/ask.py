"""`python -m ragtrain ask <output_dir> "a question" [-k K] [--json]`: answer a question with a finished run.

The run's generator answers from the top-k passages of the run's saved index, retrieved as `python -m
ragtrain search` retrieves them (in this process, no Ray; the index's checksums checked). A run with a joint stage
answers with the jointly trained query encoder and generator (`<output_dir>/joint`), a run with a generator stage
with `<output_dir>/generator`. The prompt is built by the code the generator was trained with
(ragtrain/generator/prompt.py) and the answer decoded as evaluation decodes it (greedy or `generator.eval.num_beams`,
its first line). Prints the answer, then its sources (rank, score, id, title, a snippet). Bad input: one line on
stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub when asking a run
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ragtrain.commands.search import SearchError, hit_line, load_run_config, search  # noqa: E402
from ragtrain.config import Config  # noqa: E402
from ragtrain.generator.prompt import PromptTooLongError, passage_text  # noqa: E402
from ragtrain.runtime.console import quiet_cli  # noqa: E402

if TYPE_CHECKING:
    from ragtrain.generator.model import GenModel

SNIPPET = 120  # characters of a source's "title: text" on its line


class AskError(ValueError):
    """The folder or the request cannot be served; the message names the file or the option."""


def generator_folder(cfg: Config, out: Path) -> Path:
    """The HF folder of the generator the run serves: the joint stage's, else the generator stage's."""
    # lazy: ragtrain.pipeline.export imports torch; this module's argument checks run without it
    from ragtrain.pipeline.export import served_generator

    folder = served_generator(cfg, out)
    if folder is None:
        raise AskError(
            f"{out / 'config.yaml'}: stages={list(cfg.stages)} trained no generator: ask a run whose stages "
            "include 'generator' (e.g. stages=[index,generator]) or 'joint' (e.g. stages=[index,joint])"
        )
    if not (folder / "config.json").exists():
        stage = "joint" if "joint" in cfg.stages else "generator"
        raise AskError(
            f"{folder / 'config.json'} is missing: the run's {stage} stage did not save its generator (stopped "
            "before it finished?)"
        )
    return folder


class Answerer:
    """The run's generator with the prompt code it was trained with: its tokenizer and prompt at once (the checks of
    a question need them), the model on first use (seconds: after every check has passed)."""

    def __init__(self, cfg: Config, folder: Path):
        from transformers import AutoTokenizer  # lazy: transformers is heavy (~1 s); argument checks run without it

        # lazy: ragtrain.generator.model and .steps import torch; this module's argument checks run without it
        from ragtrain.generator.model import AnswerDecoder
        from ragtrain.generator.steps import prompt_builder

        self.cfg, self.g, self.folder = cfg, cfg.generator, folder
        self.model: GenModel | None = None  # loaded on the first answer
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder))  # saved with the model, as trained
            self.builder = prompt_builder(self.g, tokenizer)
        except (OSError, ValueError) as e:  # a damaged tokenizer file, a tokenizer without the chat template...
            raise AskError(f"{folder}: not a generator this run's config can use ({str(e).splitlines()[0]})") from None
        self.decode = AnswerDecoder(tokenizer)

    def check(self, question: str) -> None:
        """The question alone (with the template's fixed tokens) fits generator.max_source_length: passages are cut
        to fit, a question never is."""
        try:
            self.builder.source(question, [])
        except PromptTooLongError as e:
            raise AskError(str(e)) from None

    def __call__(self, question: str, hits: Sequence[dict[str, Any]]) -> str:
        """The answer given the hits in rank order (as many as fit the prompt, the last cut)."""
        import torch  # lazy: torch is heavy (seconds); this module's argument checks run without it
        from safetensors import SafetensorError  # lazy, as torch above

        # lazy: ragtrain.generator.saved and .steps import torch; this module's argument checks run without it
        from ragtrain.generator.saved import load_generator
        from ragtrain.generator.steps import autocast

        if self.model is None:
            try:
                self.model = load_generator(self.cfg, self.folder)
            except (OSError, ValueError, SafetensorError) as e:  # e.g. a truncated weights file
                raise AskError(f"{self.folder}: not a loadable generator ({str(e).splitlines()[0]})") from None
        texts = [passage_text(h["title"], h["text"], self.g.include_title) for h in hits if h["text"]]
        m, g = self.model, self.g
        batch = m.arch.collate([self.builder.source(question, texts)], [[]], m.pad_id, for_generation=True)
        with torch.no_grad(), autocast(g.train.precision, torch.device("cpu")):
            ids = m.generate(batch["input_ids"], batch["attention_mask"], g.eval.num_beams, g.eval.max_new_tokens)
        return self.decode(ids[0])


def ask(out: str | Path, question: str, k: int | None = None) -> dict[str, Any]:
    """{question, k, answer, sources: [{rank, score, id, title, text}], generator} for `question` from the run in
    `out`; k defaults to the run's generator.retrieval.top_k."""
    out = Path(out)
    if not question.strip():
        raise AskError("the question is empty")
    if k is not None and k <= 0:
        raise AskError(f"-k must be > 0, got {k}")
    if not out.is_dir():
        raise AskError(f"{out} does not exist or is not a folder: give a run's output_dir")
    cfg = load_run_config(out)
    folder = generator_folder(cfg, out)
    answerer = Answerer(cfg, folder)
    answerer.check(question)  # before the index is read
    k = k or cfg.generator.retrieval.top_k
    _, hits = search(out, question, k)  # the index's checksums and k's range checked before the generator loads
    return {"question": question, "k": k, "answer": answerer(question, hits), "sources": hits, "generator": str(folder)}


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; returns the exit code (2 on bad input)."""
    quiet_cli()  # no Hugging Face loading bars around the answer
    ap = argparse.ArgumentParser(prog="python -m ragtrain ask", description=__doc__.splitlines()[0])
    ap.add_argument("output_dir", help="a finished run's folder (holds config.yaml, index/ and a generator)")
    ap.add_argument("question")
    ap.add_argument("-k", type=int, default=None, help="passages to retrieve (default: generator.retrieval.top_k)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    try:
        result = ask(args.output_dir, args.question, args.k)
    except (AskError, SearchError) as e:
        print(f"ask error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
        return 0
    print(f"answer: {result['answer']}\n\nsources:")
    for h in result["sources"]:
        print(hit_line(h, SNIPPET))
    return 0
