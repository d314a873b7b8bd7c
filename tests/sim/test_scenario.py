"""Scenario files: defaults, aliases, and errors that name the file, the field and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rolegate_sim.scenario import (
    DEFAULT_REPLY,
    FAULT_KINDS,
    MalformedToolCallFault,
    RateLimitFault,
    ScenarioError,
    SplitWritesFault,
    load_scenario,
    parse_faults,
    parse_scenario,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "scenario.yaml"


def _one_machine(**machine: Any) -> dict[str, Any]:
    return {"models": [{"name": "org/m", "machines": [{"name": "x", **machine}]}]}


def _error(data: Any) -> str:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data, source="s.yaml")
    return str(caught.value)


def test_the_example_scenario_loads_and_matches_the_example_manifests() -> None:
    scenario = load_scenario(EXAMPLE)
    assert [m.name for m in scenario.models] == ["qwen/qwen3-coder", "deepseek/deepseek-v3"]
    qwen = scenario.model("qwen/qwen3-coder")
    assert qwen is not None
    assert [m.name for m in qwen.machines] == ["fastco", "steadyco", "slowco"]
    assert scenario.seed == 7
    assert scenario.charset is None


def test_defaults() -> None:
    scenario = parse_scenario(_one_machine())
    assert scenario.seed == 0
    assert scenario.charset is None
    model = scenario.models[0]
    assert model.reply == DEFAULT_REPLY
    assert (model.reasoning, model.reasoning_field) == ("", "reasoning_content")
    assert (model.tool_calls, model.argument_piece_chars) == ((), 5)
    # The default reply exercises every UTF-8 sequence length.
    assert {len(ch.encode()) for ch in DEFAULT_REPLY} == {1, 2, 3, 4}
    machine = model.machines[0]
    assert machine.ttft_seconds is None
    assert machine.tokens_per_second is None
    assert machine.jitter == 0
    assert machine.continues_partial_message is False
    assert machine.echoes_prefill is False
    assert machine.faults == ()


def test_camel_case_aliases_and_snake_case_names_are_both_accepted() -> None:
    camel = parse_scenario(_one_machine(ttftSeconds=0.5, continuesPartialMessage=True))
    snake = parse_scenario(_one_machine(ttft_seconds=0.5, continues_partial_message=True))
    assert camel == snake
    assert camel.models[0].machines[0].ttft_seconds == 0.5


def test_fault_parameters_and_defaults() -> None:
    faults = (
        parse_scenario(
            _one_machine(
                faults=[
                    {"kind": "rateLimit", "probability": 0.5, "retryAfterSeconds": 3},
                    {"kind": "splitWrites", "always": True},
                ]
            )
        )
        .models[0]
        .machines[0]
        .faults
    )
    limit, split = faults
    assert isinstance(limit, RateLimitFault)
    assert limit.retry_after_seconds == 3
    assert isinstance(split, SplitWritesFault)
    assert split.piece_bytes is None
    assert split.pause_seconds == 0.005


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_fault_kind_parses_with_its_minimal_parameters(kind: str) -> None:
    required = {
        "lateFirstToken": {"seconds": 1},
        "rateCollapse": {"tokensPerSecond": 5},
        "keepAliveComments": {"seconds": 2},
    }
    (fault,) = parse_faults([{"kind": kind, "always": True, **required.get(kind, {})}], source="t")
    assert fault.kind == kind


def test_an_unknown_field_names_file_path_and_suggests_the_spelling() -> None:
    message = _error(_one_machine(tokensPerSec=10))
    assert message.startswith("s.yaml: ")
    assert "models[0].machines[0].tokensPerSec" in message
    assert "did you mean `tokensPerSecond`" in message


def test_a_fault_without_a_trigger_is_rejected_with_its_path_and_kind() -> None:
    message = _error(_one_machine(faults=[{"kind": "reset"}, {"kind": "cut", "always": True}]))
    assert "models[0].machines[0].faults[0]:" in message
    assert "exactly one trigger" in message
    assert "`reset` fault" in message


def test_a_fault_with_two_triggers_is_rejected() -> None:
    message = _error(_one_machine(faults=[{"kind": "cut", "always": True, "schedule": [1]}]))
    assert "found schedule, always" in message


def test_an_outage_window_must_end_after_it_begins() -> None:
    message = _error(_one_machine(faults=[{"kind": "reset", "duringSeconds": [5, 5]}]))
    assert "faults[0]" in message
    assert "from < until" in message


def test_an_out_of_range_value_names_the_field() -> None:
    message = _error(_one_machine(faults=[{"kind": "stall", "probability": 1.5}]))
    assert "models[0].machines[0].faults[0].probability" in message
    assert "less than or equal to 1" in message
    assert "(got 1.5)" in message


def test_an_unknown_fault_kind_lists_the_known_ones() -> None:
    message = _error(_one_machine(faults=[{"kind": "explode", "always": True}]))
    assert "unknown fault kind 'explode'" in message
    assert "rateLimit" in message


def test_a_missing_required_fault_parameter_is_named() -> None:
    message = _error(_one_machine(faults=[{"kind": "rateCollapse", "always": True}]))
    assert "faults[0].tokensPerSecond: required field is missing" in message


def test_duplicate_machine_names_are_rejected() -> None:
    data = {"models": [{"name": "org/m", "machines": [{"name": "x"}, {"name": "x"}]}]}
    assert "models[0].machines: machine name 'x' appears more than once" in _error(data)


def test_machine_names_cannot_contain_a_slash() -> None:
    message = _error({"models": [{"name": "org/m", "machines": [{"name": "a/b"}]}]})
    assert "models[0].machines[0].name" in message


def test_a_model_needs_machines_and_a_scenario_needs_models() -> None:
    assert "at least one machine" in _error({"models": [{"name": "m", "machines": []}]})
    assert "models: required field is missing" in _error({})
    assert "must be a mapping" in _error(["not", "a", "mapping"])


def test_the_reasoning_field_is_one_of_the_two_that_servers_use() -> None:
    model = {
        "name": "org/m",
        "reasoning": "hmm",
        "reasoningField": "reasoning",
        "machines": [{"name": "x"}],
    }
    assert parse_scenario({"models": [model]}).models[0].reasoning_field == "reasoning"
    message = _error({"models": [{**model, "reasoningField": "thoughts"}]})
    assert "models[0].reasoningField: Input should be 'reasoning_content' or 'reasoning'" in message
    assert "(got 'thoughts')" in message


def _model(**fields: Any) -> dict[str, Any]:
    return {"models": [{"name": "org/m", **fields, "machines": [{"name": "x"}]}]}


def test_tool_calls_parse_with_their_arguments_as_text() -> None:
    calls = [{"name": "f", "arguments": '{"a": '}, {"name": "g", "arguments": "", "id": "c1"}]
    model = parse_scenario(_model(toolCalls=calls, argumentPieceChars=2)).models[0]
    assert [(c.name, c.arguments, c.id) for c in model.tool_calls] == [
        ("f", '{"a": ', None),
        ("g", "", "c1"),
    ]
    assert model.argument_piece_chars == 2


def test_bad_tool_calls_are_named_with_their_path() -> None:
    message = _error(_model(toolCalls=[{"name": "", "argument": "{}"}], argumentPieceChars=0))
    assert "models[0].toolCalls[0].name: String should have at least 1 character" in message
    assert "models[0].toolCalls[0].arguments: required field is missing" in message
    assert (
        "models[0].toolCalls[0].argument: unknown field `argument`; did you mean `arguments`?"
        in message
    )
    assert (
        "models[0].argumentPieceChars: Input should be greater than or equal to 1 (got 0)"
        in message
    )
    same = [
        {"name": "f", "arguments": "{}", "id": "c"},
        {"name": "g", "arguments": "{}", "id": "c"},
    ]
    assert "models[0].toolCalls: tool call id 'c' appears more than once" in _error(
        _model(toolCalls=same)
    )


def test_a_malformed_tool_call_fault_names_its_flaws() -> None:
    (fault,) = parse_faults([{"kind": "malformedToolCall", "always": True}], source="t")
    assert fault.kind == "malformedToolCall"
    assert isinstance(fault, MalformedToolCallFault)
    assert fault.flaw == "arguments"
    bad = [{"kind": "malformedToolCall", "always": True, "flaw": "id"}]
    message = _error(_one_machine(faults=bad))
    assert "models[0].machines[0].faults[0].flaw: Input should be 'arguments' or 'name'" in message
    assert "(got 'id') (in a `malformedToolCall` fault)" in message


def test_charset_is_null_or_utf8() -> None:
    assert parse_scenario({**_one_machine(), "charset": "utf-8"}).charset == "utf-8"
    assert "charset" in _error({**_one_machine(), "charset": "latin-1"})


def test_load_reports_yaml_syntax_errors_with_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("models: [\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match=r"broken\.yaml: not valid YAML"):
        load_scenario(path)


def test_load_reports_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"absent\.yaml: cannot read scenario file"):
        load_scenario(tmp_path / "absent.yaml")


def test_load_validates_with_the_file_name_in_the_message(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  - name: m\n    machines:\n      - name: x\n        jitter: 3\n")
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert str(caught.value).startswith(f"{path}: invalid scenario")
    assert "models[0].machines[0].jitter" in str(caught.value)


def test_json_scenarios_load_too(tmp_path: Path) -> None:
    path = tmp_path / "scenario.json"
    path.write_text('{"seed": 3, "models": [{"name": "m", "machines": [{"name": "x"}]}]}')
    assert load_scenario(path).seed == 3
