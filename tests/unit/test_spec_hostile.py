"""Hostile specs: every malformed file, encoding and --set value is a short ConfigError (CLI exit 2),
never a traceback, a hang or a huge message; a hypothesis fuzz over the CLI and `load_spec`.
Bombs (aliases, nesting) are stopped by counters, which the messages prove fired; a hang is caught
by the suite's timeout. Wall-clock seconds are not asserted: this host is shared."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.cli import main
from workbench.errors import ConfigError
from workbench.spec import JobSpec, load_spec
from workbench.spec_input import MAX_MESSAGE_CHARS, parse_yaml

QUICKSTART = "examples/quickstart.yaml"
_ANCHORS = "abcdefghij"


def alias_bomb(levels: int = 9, flow: bool = False) -> str:
    """Billion laughs: each level lists the previous one 9 times (9**levels values)."""
    items = [f"&a [{', '.join(['x'] * 9)}]"] + [
        f"&{_ANCHORS[i]} [{', '.join(['*' + _ANCHORS[i - 1]] * 9)}]" for i in range(1, levels)]
    if flow:
        return "[" + ", ".join(items) + "]"
    return "".join(f"l{i}: {item}\n" for i, item in enumerate(items)) + f"name: *{_ANCHORS[levels - 1]}\n"


def cli(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("encoding, ok", [("latin-1", False), ("utf-16", True), ("utf-8-sig", True)])
def test_file_encodings(tmp_path, capsys, encoding, ok):
    path = tmp_path / "s.yaml"
    path.write_text("name: café\nlayout: {dp: 2}\n", encoding=encoding)
    code, err = cli(capsys, "validate", str(path))
    assert code == (0 if ok else 2)
    if not ok:
        assert "not UTF-8 text" in err and "save a spec file as UTF-8" in err


@pytest.mark.parametrize("value, needle", [
    ("!!binary aGVsbG8=", "binary data (5 bytes) is not a spec value"),
    ("!!timestamp 2024-01-01", "a date (2024-01-01) is not a spec value"),
    ("caf\udce9", "not UTF-8 text"),  # what argv holds for a Latin-1 byte
    ("[" * 1000 + "]" * 1000, "nested more than 32 levels deep"),
    (alias_bomb(flow=True), "aliases expand to more than"),
    ("&a [*a]", "refers to its own anchor"),
])
def test_set_values(capsys, value, needle):
    for key in ("name", "model.kwargs.x", "unknown"):
        code, err = cli(capsys, "validate", QUICKSTART, "--set", f"{key}={value}")
        assert code == 2 and needle in err, err


def test_a_bare_date_is_a_name():
    assert load_spec(QUICKSTART, ["name=2024-01-01"]).name == "2024-01-01"


@pytest.mark.parametrize("text, needle", [
    (alias_bomb(), "aliases expand to more than 20,000 values"),
    ("name: job\nmodel: {preset: gpt-tiny, kwargs: {x: " + "[" * 1000 + "]" * 1000 + "}}\n", "nested more than"),
    ("name: job\n" + "a:\n" + "".join("  " * i + " b:\n" for i in range(1, 300)), "nested more than"),
    ("name: !!python/object:os.system ls\n", "not valid YAML"),
    ("? [a]\n: b\n", "not valid YAML"),
    ("1: 2\n", "keys must be text"),
])
def test_files(tmp_path, capsys, text, needle):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    code, err = cli(capsys, "memory", str(path))
    assert code == 2 and needle in err, err


def test_messages_are_capped(tmp_path, capsys):
    code, err = cli(capsys, "validate", QUICKSTART, "--set", "layout.dp=" + "x" * 10**6,
                    "--set", "name=" + "[" + "1," * 10**5 + "1]")
    assert code == 2 and len(err) < MAX_MESSAGE_CHARS + 200


def test_python_dicts_get_the_same_checks():
    shared: list = ["x"] * 10
    for _ in range(8):
        shared = [shared] * 10  # a DAG of 10**9 leaves built in microseconds
    with pytest.raises(ConfigError, match="more than 20,000 values"):
        load_spec({"name": "job", "model": {"preset": "gpt-tiny", "kwargs": {"x": shared}}})
    with pytest.raises(ConfigError, match=r"name: binary data"):
        load_spec({"name": b"job"})


# -- fuzz: the families above, mixed with arbitrary text and bytes ---------------------------------

_KEYS = st.sampled_from(["name", "layout.dp", "layout.zero", "train.steps", "model.preset", "model.kwargs.k",
                         "resources.gpu", "backend.sagemaker.role", "checkpoint.uri", "zzz", "layout", "a.b.c"])
_VALUES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["!!binary aGk=", "2024-01-01", "2024-01-01T10:00:00", "!!set {a}", "~", ".nan", "-.inf",
                     "1e400", "10" * 30, "caf\udce9", "&a [*a]", "[" * 200, "{a: [" * 50, alias_bomb(flow=True),
                     "!!python/name:os.system", "\x00", "\ufeffname", "- a\n- b"]),
    st.integers(min_value=2, max_value=2000).map(lambda n: "[" * n + "]" * n),
)
_FILES = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).flatmap(lambda t: st.sampled_from(["utf-8", "utf-16", "utf-16-le", "latin-1", "utf-32"])
                                  .map(lambda enc: t.encode(enc, "replace"))),
    st.sampled_from([alias_bomb().encode(), b"name: \xff\xfe\n", b"\xef\xbb\xbfname: x\n", b"- 1\n- 2\n"]),
)
_COMMANDS = st.sampled_from(["validate", "memory", "plan", "dispatch"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=_COMMANDS, sets=st.lists(st.tuples(_KEYS, _VALUES), max_size=3))
def test_fuzz_cli_set_values(capsys, command, sets):
    extra = ["--dry-run", "--backend", "local"] if command == "dispatch" else []
    code, err = cli(capsys, command, QUICKSTART, *extra, *[a for k, v in sets for a in ("--set", f"{k}={v}")])
    assert code in (0, 2) and len(err) < MAX_MESSAGE_CHARS + 200
    assert code == 0 or err.startswith("error: ")


@settings(max_examples=60, deadline=None)
@given(data=_FILES)
def test_fuzz_load_spec_files(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "s.yaml"
    path.write_bytes(data)
    try:
        assert isinstance(load_spec(path), JobSpec)
    except ConfigError as e:
        assert len(str(e)) < MAX_MESSAGE_CHARS + 100


# -- what a file says must be what is read: no silent overwrite, no other number, no empty job -----

@pytest.mark.parametrize("text, needle", [
    ("name: a\ntrain: {steps: 30, lr: 3.0e-3}\nlayout: {dp: 2}\ntrain: {steps: 5000}\n",
     "line 4: the key 'train' is given twice in one section (first at line 2)"),
    ("name: a\nlayout: {dp: 2, dp: 1}\n", "line 2: the key 'dp' is given twice"),
    ("name: a\ntrain: {steps: 016}\n", "016 is a YAML 1.1 octal number (it reads as 14)"),
    ("name: a\ntrain: {steps: 1:30}\n", "1:30 is a YAML 1.1 base-60 number (it reads as 90)"),
    ("name: a\ntrain: {lr: 1:30.5}\n", "1:30.5 is a YAML 1.1 base-60 number"),
    ("name: a\ntrain: {steps: 0b101}\n", "0b101 is a YAML 1.1 binary number (it reads as 5)"),
    ("name: a\nlayout: {dp: true}\n", "layout.dp: expected a number, got true (a boolean)"),
    ("name: a\nresources: {nodes: yes}\n", "resources.nodes: expected a number, got true (a boolean)"),
    ("", "is empty (or only comments)"),
    ("# only a comment\n", "is empty (or only comments)"),
    ("name: a\nextra: [" + ",".join(["1"] * 400_000) + "]\n", "more than 20,000 values (line 2)"),
])
def test_what_a_file_says_is_what_is_read_or_refused(tmp_path, capsys, text, needle):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    code, err = cli(capsys, "validate", str(path))
    assert code == 2 and needle in err, err


def test_a_later_key_may_override_a_merged_one_and_numbers_keep_their_decimal_forms():
    text = "a: &b {x: 1, y: 2}\nc: {<<: *b, x: 3}\nn: [1_000, 0x10, 0, -7, 1.5e+3, '016', 08:00]\n"
    assert parse_yaml(text, "t") == {"a": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2},
                                     "n": [1000, 16, 0, -7, 1500.0, "016", "08:00"]}
    assert load_spec(QUICKSTART, ["model.tie_embeddings=true"]).model.tie_embeddings is True  # a boolean field


@pytest.mark.parametrize("override, needle", [
    ("train.steps=true", "train.steps: expected a number, got true (a boolean)"),
    ("train.lr=false", "train.lr: expected a number, got false (a boolean)"),
    ("train.global_batch=016", "016 is a YAML 1.1 octal number"),
    (".layout.dp=4", "the key path '.layout.dp' has an empty part"),
    ("layout..dp=4", "has an empty part"),
    ("name=a\x1b[2J", "a control character (U+001B) at position 1"),
])
def test_set_values_read_as_written_or_refused(capsys, override, needle):
    code, err = cli(capsys, "validate", QUICKSTART, "--set", override)
    assert code == 2 and needle in err, err


def test_keys_and_values_are_printed_without_their_control_characters(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text('name: a\n"bogus\\e[2Jkey": 1\n')
    code, err = cli(capsys, "validate", str(path))
    assert code == 2 and "bogus\\x1b[2Jkey: unknown key" in err and "\x1b" not in err


def test_no_spec_path_and_names_too_long_for_the_file_system(capsys, monkeypatch, tmp_path):
    code, err = cli(capsys, "validate", "")
    assert code == 2 and "no spec file given" in err
    code, err = cli(capsys, "validate", "a" * 300)
    assert code == 2 and "cannot read it: File name too long" in err
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / ("h" * 300)))
    monkeypatch.delenv("WORKBENCH_PROFILE", raising=False)
    code, err = cli(capsys, "plan", QUICKSTART)
    assert code == 2 and "under $WORKBENCH_HOME): cannot read it: File name too long" in err


def test_plan_top_is_a_positive_count(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", QUICKSTART, "--top=-1"])
    assert exc.value.code == 2 and "a whole number from 1" in capsys.readouterr().err
