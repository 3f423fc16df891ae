"""The model id covers the config as loaded (issue 16): a converted model whose config.json was
edited afterwards (top-k, an epsilon, a type) is refused with one line naming the file, exit 2,
by every command that opens it; restored, it loads again. And bad generate options that
used to end in a traceback or be accepted are one line, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest

from moeshard.cli import main
from moeshard.moe.errors import StoreError
from moeshard.moe.model.model_dir import ModelDir


@pytest.fixture
def model(converted, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(converted("qwen3_moe"), dst)
    return dst


@pytest.mark.parametrize(
    "edit",
    [{"num_experts_per_tok": 4}, {"rms_norm_eps": 0.5}, {"hidden_size": "banana"}],
    ids=["top-k", "eps", "banana"],
)
def test_an_edited_config_is_refused_naming_the_file(model, capsys, edit):
    path = model / "config.json"
    original = path.read_text()
    config = json.loads(original)
    config.update(edit)
    path.write_text(json.dumps(config, indent=2))
    with pytest.raises(StoreError, match="config.json: changed since conversion"):
        ModelDir(model)
    code = main(["generate", str(model), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(path) in err[0], err
    path.write_text(original)
    ModelDir(model).close()  # restored: accepted again


def test_reformatting_the_config_is_not_a_change(model):
    """The id covers the config as loaded (canonical JSON), not its spacing or key order."""
    path = model / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(config.items()))), indent=7))
    ModelDir(model).close()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--prompt-ids", ""], "--prompt-ids: no token ids given"),
        (["--prompt", ""], "--prompt: the prompt is empty"),
        (["--prompt-ids", "1,2", "--temperature", "nan"], "--temperature nan"),
        (["--prompt-ids", "1,2", "--temperature", "inf"], "--temperature inf"),
        (["--prompt-ids", "1,2", "--top-p", "nan"], "--top-p"),
    ],
)
def test_bad_generate_options_are_one_line_and_exit_2(converted, capsys, args, says):
    """Issue 16: these ended in a traceback (empty prompt) or were accepted (uniform random
    text at temperature inf)."""
    code = main(["generate", str(converted("qwen3_moe")), "--max-tokens", "2", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
