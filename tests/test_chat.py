"""Chat formatting (`coordinator/chat.py`): a checkpoint's Jinja chat template rendered as
transformers renders it, Kimi K3's own turn format, and `generate --chat`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from moeshard.coordinator.chat import chat_prompt, k3_prompt
from moeshard.coordinator.tokenizer import load as load_text_tokenizer
from moeshard.moe.convert.converter import convert
from moeshard.moe.convert.synth import synth
from moeshard.moe.errors import MoeshardError

# ChatML as Qwen publishes it (the common shape: a loop over messages, a generation prompt)
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


def with_template(tmp_path, template, **tokens):
    config = {"chat_template": template, **tokens}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_jinja_template_renders_as_transformers_does(tmp_path):
    got = chat_prompt(with_template(tmp_path, CHATML), "qwen3_moe", MESSAGES)
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
    assert got == want + "<|im_start|>assistant\n"
    bare = chat_prompt(tmp_path, "qwen3_moe", MESSAGES, add_generation_prompt=False)
    assert bare == want


def test_template_variables_helpers_and_named_templates(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}"
        "{{ m['content'] | tojson }}{% endfor %}"
        "{% if not enable_thinking %}/no_think{% endif %}"
    )
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    path = with_template(tmp_path, named, bos_token={"content": "<s>"})
    assert chat_prompt(path, "mixtral", MESSAGES, thinking=False) == '<s>"Be brief.""Hi?"/no_think'
    with pytest.raises(MoeshardError, match="the chat template failed: no tools here"):
        chat_prompt(path, "mixtral", [{"role": "tool", "content": "{}"}])


def test_a_template_cannot_reach_python(tmp_path):
    """The sandbox transformers uses: no attribute walk to os or subprocess."""
    path = with_template(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(MoeshardError, match="chat template failed"):
        chat_prompt(path, "qwen3_moe", MESSAGES)


def test_no_template_is_an_error_outside_k3(tmp_path):
    with pytest.raises(MoeshardError, match="no chat template"):
        chat_prompt(tmp_path, "qwen3_moe", MESSAGES)


# Harmony's turn shape (gpt-oss; its release ships the template as chat_template.jinja)
HARMONY = (
    "{% for m in messages %}<|start|>{{ m['role'] if m['role'] != 'system' else 'developer' }}"
    "<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_chat_template_jinja_wins_and_convert_keeps_it(tmp_path):
    """transformers now saves a template as chat_template.jinja (gpt-oss ships it so): read
    before tokenizer_config.json's, and copied by `convert`."""
    from helpers import FIXTURES

    src = tmp_path / "src"
    src.mkdir()
    for f in (FIXTURES / "gpt_oss").iterdir():
        if f.name not in ("reference.npz", "meta.json", "config.rope_parameters.json"):
            (src / f.name).symlink_to(f)
    (src / "chat_template.jinja").write_text(HARMONY)
    convert(src, tmp_path / "model", progress=False)
    with_template(tmp_path / "model", CHATML)  # (an older template beside it: not used)
    got = chat_prompt(tmp_path / "model", "gpt_oss", MESSAGES)
    assert got == (
        "<|start|>developer<|message|>Be brief.<|end|><|start|>user<|message|>Hi?<|end|>"
        "<|start|>assistant"
    )


def test_kimi_k3_turns():
    """K3's XTML turns, as the encoder derived from the release's encoding_k3.py writes them."""
    history = [*MESSAGES, {"role": "assistant", "content": "Hello.", "reasoning_content": "Hm."}]
    history.append({"role": "user", "content": "More?"})
    got = k3_prompt(history, add_generation_prompt=True, thinking=True)
    assert got == (
        '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Hi?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Hm.<|close|>think<|sep|>'
        "<|open|>response<|sep|>Hello.<|close|>response<|sep|><|close|>message<|sep|>"
        "<|end_of_msg|>"
        '<|open|>message role="user"<|sep|>More?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    plain = k3_prompt(MESSAGES[1:], add_generation_prompt=True, thinking=False)
    assert plain.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_generate_chat_on_a_k3_encodes_the_turn_markers_as_special_tokens(tmp_path):
    synth(tmp_path / "ckpt", "k3", checkpoint=True)
    convert(tmp_path / "ckpt", tmp_path / "model", progress=False)
    model = tmp_path / "model"
    cmd = [sys.executable, "-m", "moeshard", "generate", str(model), "--max-tokens", "1"]
    out = subprocess.run(
        [*cmd, "--prompt", "Hi?", "--chat", "--system", "Be brief.", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout)["prompt_ids"]
    tok = load_text_tokenizer(model)
    assert ids == tok.encode(chat_prompt(model, "kimi_k3", MESSAGES))
    special = {tok.special[t] for t in ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>")}
    assert sum(i in special for i in ids) == 2 * 5 + 4  # 5 per turn, 4 opening the answer
    bad = subprocess.run(
        [*cmd, "--prompt-ids", "1,2", "--chat"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "format a --prompt text" in bad.stderr
