"""The command line's voice: every --help true, every usage error one line naming its flag (from the
command line, a variable or the config file), and where each setting comes from."""

from __future__ import annotations

import re

import pytest
from fake_engine import FakeEngine
from helpers.cli import invoke

from swiftspec import cli
from swiftspec.settings import CHAT_DEFAULTS


def test_help_lists_every_flag():
    out = invoke(["chat", "--help"], b"").output
    for flag in ("-m", "--model", "--target", "--draft", "--target-devices", "--draft-devices", "--gpus", "--target-procs",
                 "--draft-procs", "--mode", "--temperature", "--top-p", "--top-k", "--seed", "--max-new-tokens",
                 "--system", "--bs", "--w", "--d", "--max-seq-len", "--trust-remote-code", "--prompt", "--each-line",
                 "--jsonl", "--resume", "--threads", "--stop", "--device", "--dtype"):
        assert flag in out, flag
    bench = invoke(["bench", "--help"]).output
    for flag in ("--modes", "--prompts", "--set", "--limit", "--max-new-tokens", "--json", "--plot", "--target",
                 "--draft-devices", "--temperature", "--top-p", "--top-k", "--seed", "--system", "--bs", "--w", "--d"):
        assert flag in bench, flag
    assert "--install-completion" in invoke(["--help"]).output
    root = invoke(["--help"]).output
    assert re.search(r"--version\s+-V\s", root), root  # typer's columns: long name, short name
    # where values come from, and in which order, is said in the help itself
    assert "the flag, the environment variable, the config file, the default" in " ".join(out.split())
    assert "SWIFTSPEC_MAX_NEW_TOKENS" in out


def test_one_metavar_style():
    """Every option that takes a value names it with one upper-case word; flags name nothing."""
    import typer

    group = typer.main.get_command(cli.app)
    checked = 0
    for name, command in group.commands.items():
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                checked += 1
                if param.is_flag:
                    assert not param.metavar, (name, param.name)
                else:
                    assert param.metavar and param.metavar.isupper() and param.metavar.isalpha(), (name, param.name)
    assert checked > 40


def _commands(group, path=()):
    """Every command and group under ``group``, by the words that name it."""
    for name, command in group.commands.items():
        yield (*path, name), command
        yield from _commands(command, (*path, name)) if hasattr(command, "commands") else ()


@pytest.mark.parametrize("columns", [100, 230])
def test_every_help_tells_the_truth(columns, monkeypatch):
    """Each command's --help renders; a flag shows no metavar (no "<bool>"); the footer's "every option but
    ..." names exactly the options that no variable or config key sets; descriptions are one line per
    paragraph in the source, so the formatter wraps them at any width."""
    import inspect

    import typer

    monkeypatch.setenv("COLUMNS", str(columns))
    root = typer.main.get_command(cli.app)
    rendered = 0
    for path, command in [((), root), *_commands(root)]:
        result = invoke([*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output and max(map(len, result.output.splitlines())) <= columns, path
        for paragraph in inspect.cleandoc(command.help or "").split("\n\n"):
            assert "\n" not in paragraph, (path, paragraph)  # hand-wrapped: ragged at any other width
        text = " ".join(result.output.split())
        options = [p for p in command.params if p.param_type_name == "option" and p.name != "help"]
        unsettable = {p.opts[0] for p in options if not p.envvar}
        if "Every option can" in text:
            assert not unsettable, (path, unsettable)
        if "Every option but" in text:
            named = re.search(r"Every option but (.+?) can also", text).group(1)
            assert set(re.findall(r"-{1,2}[a-z][\w-]*", named)) == unsettable, (path, named)
        rendered += 1
    assert rendered >= 12  # the root, 6 commands, 2 groups and their 6 commands


@pytest.mark.parametrize("args, flag, message", [
    (["chat", "-p", "hi", "--mode", "turbo"], "--mode", "'turbo' is not a mode; ar, sync or async"),
    (["chat", "-p", "hi", "--temperature", "hot"], "--temperature", "'hot' is not a number; a number such as 0.7"),
    (["chat", "-p", "hi", "--temperature", "-1"], "--temperature", "-1.0 is out of range; a finite number >= 0"),
    (["chat", "-p", "hi", "--top-p", "0"], "--top-p", "0.0 is out of range; a number in (0, 1]"),
    (["chat", "-p", "hi", "--target-devices", "0,x", "--draft-devices", "1"], "--target-devices", "'0,x'"),
    (["chat", "-p", "hi", "--target-devices", "0,1"], "--target-devices", "given without --draft-devices"),
    (["chat", "-p", "hi", "--gpus", "4", "--target-devices", "0", "--draft-devices", "1"], "--gpus",
     "chooses the split itself"),
    (["chat", "-p", "hi", "--bs", "0"], "--bs", "0 is out of range; a whole number in 1..64 (nodes verified per target forward)"),
    (["chat", "-p", "hi", "--resume", "abc"], "--resume", "'abc' is not a conversation id"),
    (["chat", "-p", "hi", "--max-new-tokens", "-5"], "--max-new-tokens", "-5 is out of range; a whole number >= 1"),
    (["chat", "-p", "hi", "--top-k", "-3"], "--top-k", "a whole number >= 0"),
    (["chat", "-p", "hi", "--gpus", "1"], "--gpus", "1 is out of range; a whole number >= 2 (one group for the target"),
    (["chat", "-p", "hi", "--threads", "0"], "--threads", "0 is out of range; a whole number >= 1"),
    (["chat", "-p", "hi", "--target-procs", "0"], "--target-procs", "at least one process"),
    (["chat", "-p", "hi", "--max-seq-len", "8"], "--max-seq-len", "8 is out of range; a whole number >= 16"),
    (["chat", "-p", "hi", "--min-p", "1.5"], "--min-p", "in [0, 1]"),
    (["chat", "-p", "hi", "--repeat-penalty", "0"], "--repeat-penalty", "a finite number > 0"),
    (["chat", "-p", "hi", "--repeat-last-n", "0"], "--repeat-last-n", "a whole number >= 1"),
    (["chat", "-p", "hi", "--presence-penalty", "3"], "--presence-penalty", "in [-2, 2]"),
    (["chat", "-p", "hi", "--frequency-penalty", "nan"], "--frequency-penalty", "in [-2, 2]"),
    (["chat", "-p", "hi", "--loop-repeats", "1"], "--loop-repeats", "a whole number >= 2"),
    (["chat", "-p", "hi", "--dtype", "int3"], "--dtype", "'int3' is not a dtype; auto, float32"),
    (["chat", "-p", "hi", "--draft-history", "maybe"], "--draft-history", "on or off"),
    (["chat", "-p", "hi", "--draft", "/nope"], "--draft", "no draft at '/nope'; suffix, int8, none, or a model"),
    (["chat", "-p", "hi", "-m", "/nope"], "-m", "no model at '/nope'; a Hugging Face model directory"),
    (["chat", "-p", "hi", "--target", "/nope"], "--target", "no model at '/nope'"),
    (["chat", "-p", "hi", "--bogus"], "--bogus", "no such option; "),
    (["chat", "-p", "hi", "--sed", "3"], "--sed", "no such option; did you mean --d or --save or --seed?"),
    (["chat", "-p", "hi", "--seed"], "--seed", "needs a value; a whole number"),
    (["chat", "one", "two"], "chat", "unexpected extra argument"),
    (["serve", "--port", "abc"], "--port", "'abc' is not a whole number; a whole number in 0..65535"),
    (["serve", "--port", "70000"], "--port", "70000 is out of range; a whole number in 0..65535"),
    (["serve", "--max-queue", "0"], "--max-queue", "0 is out of range; a whole number >= 1"),
    (["chat", "-p", "hi", "--resume", "999"], "--resume", "no conversation with id 999 in "),
    (["chat", "-p", "hi", "--grammar", "/dev/null"], "--grammar", "No 'root' rule found; a file holding a Lark"),
    (["serve", "--host", "0.0.0.0"], "--host", "0.0.0.0 is reachable from other machines; give an --api-key"),
    (["bench", "--modes", "ar,turbo"], "--modes", "'turbo' is not a mode; comma-separated modes: hf, "),
    (["bench", "--modes", ","], "--modes", "no mode given; comma-separated modes: "),
    (["bench", "--set", "chat,nope"], "--set", "'nope' is not a prompt set; comma-separated sets: chat, "),
    (["bench", "--prompts", "/nope"], "--prompts", "'/nope' cannot be read (No such file or directory); a JSONL"),
    (["bench", "--json", "/nope/r.json"], "--json", "cannot write '/nope/r.json': /nope is not a directory; "),
    (["bench", "--plot", "/nope/r.png", "--modes", "ar"], "--plot", "/nope is not a directory; a file in an"),
    (["bench", "--warm", "2", "--modes", "hf"], "--warm", "no engine mode runs; 0 unless --modes runs an engine"),
    (["bench", "--turns", "some"], "--turns", "first or all"),
    (["bench", "--limit", "0"], "--limit", "0 is out of range; a whole number >= 1"),
    (["train-draft", "--out", "x", "--steps", "0"], "--steps", "0 is out of range; a whole number in 1..8"),
    (["train-draft", "--out", "x", "--lr", "0"], "--lr", "a finite number > 0"),
    (["train-draft"], "--out", "missing; see swiftspec train-draft --help"),
    (["train-draft", "--out", "x", "-m", "/nope"], "-m", "no model at '/nope'; a Hugging Face model directory"),
    (["history", "show", "abc"], "ID", "'abc' is not a whole number; a whole number >= 1 (a conversation id"),
    (["history", "list", "-n", "0"], "-n", "0 is out of range"),
    (["history", "export", "1", "--format", "pdf"], "--format", "'pdf' is not a format; md or json"),
])
def test_every_usage_error_is_one_line_that_names_the_flag(args, flag, message, fake, data_dir):
    """Typer's parser errors and our own checks alike: `swiftspec: FLAG: WHAT IS WRONG; WHAT IS ACCEPTED`,
    exit 2, no box, nothing on stdout, before any engine starts."""
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"swiftspec: {flag}: ") and "; " in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert not re.search("[╭│╰]|Traceback|Invalid value|Usage:", result.stderr) and result.stdout == ""
    assert not fake  # refused before any engine starts


def test_a_value_from_the_environment_is_named_by_its_variable(fake, data_dir, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_TEMPERATURE", "hot")
    result = invoke(["chat", "-p", "hi"])
    assert result.exit_code == 2
    assert result.stderr == "swiftspec: SWIFTSPEC_TEMPERATURE: 'hot' is not a number; a number such as 0.7\n"
    monkeypatch.setenv("SWIFTSPEC_TEMPERATURE", "-1")
    assert invoke(["chat", "-p", "hi"]).stderr.startswith("swiftspec: SWIFTSPEC_TEMPERATURE: -1.0 is out of range")


def test_a_model_the_config_file_names_is_checked_only_by_the_commands_that_load_it(fake, data_dir, monkeypatch,
                                                                                   tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('target = "/gone"\n')
    monkeypatch.setenv("SWIFTSPEC_CONFIG", str(config))
    assert invoke(["history", "list"]).exit_code == 0  # a model removed since stops no other command
    result = invoke(["chat", "-p", "hi"])
    assert result.exit_code == 2 and not fake
    assert result.stderr == f"swiftspec: {config}: target: no model at '/gone'; a Hugging Face model directory " \
                            "or a .gguf file\n"


def test_with_server_a_model_flag_is_named_as_typed(fake, data_dir, tmp_path):
    model = tmp_path / "foo.gguf"
    model.write_bytes(b"GGUF")
    result = invoke(["chat", "--server", "http://127.0.0.1:9", "-m", str(model), "-p", "hi"])
    assert result.exit_code == 2 and result.stderr.startswith("swiftspec: -m: has no effect with --server; ")


def test_env_and_config_file_precedence(fake, data_dir, monkeypatch, tmp_path):
    """flag > SWIFTSPEC_<FLAG> > config file ([chat] over top level) > default, per setting."""
    config = tmp_path / "config.toml"
    config.write_text('max-new-tokens = 7\nbs = 3\nw = 5\ndraft = "int8"\n'
                      '[chat]\nw = 6\nstop = ["END"]\n[bench]\nlimit = 2\n')
    monkeypatch.setenv("SWIFTSPEC_CONFIG", str(config))
    monkeypatch.setenv("SWIFTSPEC_BS", "4")
    monkeypatch.setenv("SWIFTSPEC_MAX_NEW_TOKENS", "9")
    seen = []
    generate = FakeEngine.generate
    monkeypatch.setattr(FakeEngine, "generate", lambda self, m, p: seen.append(p) or generate(self, m, p))
    result = invoke(["chat", "hi", "--max-new-tokens", "11"])
    assert result.exit_code == 0, result.output
    config_seen = fake[0]
    assert seen[0].max_new_tokens == 11  # flag over env and file
    assert config_seen.tree.bs == 4  # env over file
    assert config_seen.tree.w == 6 and seen[0].stop == ["END"]  # [chat] over the top level
    assert config_seen.draft == "int8"  # file over default
    assert config_seen.tree.d is None and seen[0].temperature == CHAT_DEFAULTS.temperature  # default
    assert "[default: int8]" in invoke(["chat", "--help"]).output  # the help shows the file's values


@pytest.mark.parametrize("text, message", [
    ("max_new_tokens = \n", "is not valid TOML"),
    ("colour = 'red'\n", "unknown setting 'colour'"),
    ("prompt = 'hi'\n", "unknown setting 'prompt'"),
    ("[chat]\nmodes = 'ar'\n", "[chat] has no setting 'modes'"),
    ("temperature = -2\n", "{config}: temperature = -2: -2.0 is out of range; a finite number >= 0"),
    ('max-new-tokens = "abc"\n', "{config}: max-new-tokens = 'abc': 'abc' is not a whole number; a whole number such as 8"),
    ("[chat]\nbs = 100\n", "{config}: bs = 100: 100 is out of range; a whole number in 1..64 (nodes verified per target forward)"),
])
def test_bad_config_file_is_a_usage_error_naming_the_file(text, message, fake, data_dir, monkeypatch, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(text)
    monkeypatch.setenv("SWIFTSPEC_CONFIG", str(config))
    result = invoke(["chat", "-p", "hi"])
    assert result.exit_code == 2 and message.format(config=config) in result.stderr, result.output
    assert "Traceback" not in result.output and not fake


def test_bad_env_value_names_the_variable(fake, data_dir, monkeypatch):
    monkeypatch.setenv("SWIFTSPEC_MAX_NEW_TOKENS", "lots")
    result = invoke(["chat", "-p", "hi"])
    assert result.exit_code == 2 and "lots" in result.output and not fake

