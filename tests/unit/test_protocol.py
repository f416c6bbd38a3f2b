"""Training protocol: header round trips, refusals with codes, tensor checks, fuzzing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from wanswarm.node.config.runspec import ModelSpec, RunSpec, StagesSpec
from wanswarm.node.protocol import (
    BackwardReply,
    BackwardRequest,
    BadReply,
    ErrorCode,
    EvalLossRequest,
    ForwardLossRequest,
    ForwardReply,
    ForwardRequest,
    HopId,
    InfoReply,
    InfoRequest,
    LossReply,
    StageContract,
    check_relayed,
    parse_reply,
    parse_request,
    to_header,
)
from wanswarm.transport.codecs import CodecSpec, encode
from wanswarm.transport.errors import RemoteError
from wanswarm.transport.tensors import ReceivedTensor

SPEC = RunSpec(
    name="proto",
    model=ModelSpec(d_model=16, n_heads=2, n_layers=3, seq_len=8),
    stages=StagesSpec(blocks_per_stage=(1, 1, 1)),
)


def _hop(stage: int = 1, **kw: Any) -> HopId:
    fields: dict[str, Any] = {
        "run_id": SPEC.run_id,
        "trainer": "trainerA",
        "micro_batch": 7,
        "stage": stage,
    }
    fields.update(kw)
    return HopId(**fields)


def _code(exc: pytest.ExceptionInfo[RemoteError]) -> str:
    return exc.value.code


def test_request_headers_round_trip_through_plain_dicts() -> None:
    for message in (
        ForwardRequest(hop=_hop(), budget_s=5.0, keep_input=False),
        ForwardLossRequest(hop=_hop(2, attempt=3), budget_s=1.5),
        BackwardRequest(hop=_hop(0), budget_s=2.0, input_carried=True),
        EvalLossRequest(hop=_hop(2), budget_s=9.0),
        InfoRequest(run_id=SPEC.run_id),
    ):
        header = to_header(message)
        assert isinstance(header, dict)
        assert parse_request(type(message), header) == message


def test_reply_headers_round_trip_and_reject_non_finite_loss() -> None:
    reply = LossReply(queue_len=2, epoch=5, compute_s=0.01, loss=3.25, duplicate=False)
    assert parse_reply(LossReply, to_header(reply)) == reply
    info = InfoReply(
        run_id=SPEC.run_id, stage=1, state="online", queue_len=0, queue_capacity=8,
        throughput=12.5, epoch=0, samples_accumulated=16,
    )
    assert parse_reply(InfoReply, to_header(info)) == info
    bad = dict(to_header(reply), loss=math.nan)
    with pytest.raises(BadReply, match="loss"):
        parse_reply(LossReply, bad)
    with pytest.raises(BadReply):
        parse_reply(ForwardReply, {"queue_len": 0, "epoch": 0, "compute_s": 0.0})  # no 'cached'


def test_dedup_key_ignores_the_attempt_number() -> None:
    assert _hop(attempt=0).key == _hop(attempt=4).key == ("trainerA", 7, 1)
    assert _hop(micro_batch=8).key != _hop().key


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h.update(v=2),
        lambda h: h.update(extra="x"),
        lambda h: h.pop("budget_s"),
        lambda h: h.update(budget_s=-1.0),
        lambda h: h.update(budget_s=math.inf),
        lambda h: h["hop"].update(micro_batch=-1),
        lambda h: h["hop"].update(trainer="has space"),
        lambda h: h["hop"].update(run_id="x" * 500),
        lambda h: h["hop"].update(stage="one"),
        lambda h: h.update(hop=None),
    ],
)
def test_malformed_request_headers_are_refused_as_bad_request(mutate: Any) -> None:
    header = to_header(BackwardRequest(hop=_hop(), budget_s=1.0, input_carried=False))
    mutate(header)
    with pytest.raises(RemoteError) as exc:
        parse_request(BackwardRequest, header)
    assert _code(exc) == ErrorCode.BAD_REQUEST


def test_wrong_run_stage_or_trainer_is_refused_with_its_code() -> None:
    contract = StageContract.from_spec(SPEC, 1)
    contract.check_hop(_hop(), sender="trainerA")
    with pytest.raises(RemoteError) as exc:
        contract.check_hop(_hop(run_id="0123456789abcdef"), sender="trainerA")
    assert _code(exc) == ErrorCode.WRONG_RUN
    with pytest.raises(RemoteError) as exc:
        contract.check_hop(_hop(2), sender="trainerA")
    assert _code(exc) == ErrorCode.WRONG_STAGE
    with pytest.raises(RemoteError) as exc:
        contract.check_hop(_hop(), sender="someoneElse")
    assert _code(exc) == ErrorCode.BAD_REQUEST


def test_stage_inputs_are_checked_for_dtype_shape_range_and_finiteness() -> None:
    first, middle = StageContract.from_spec(SPEC, 0), StageContract.from_spec(SPEC, 1)
    B, T, C = SPEC.batch.micro_batch_size, SPEC.model.seq_len, SPEC.model.d_model
    first.check_input(torch.randint(0, 256, (B, T)))
    middle.check_input(torch.zeros(B, T, C))
    refused = [
        (first, torch.zeros(B, T)),  # float ids
        (first, torch.full((B, T), 256)),  # out of vocabulary
        (first, torch.full((B, T), -1)),
        (first, torch.zeros(B, T + 1, dtype=torch.int64)),  # longer than seq_len
        (first, torch.zeros(B + 1, T, dtype=torch.int64)),  # larger than a micro-batch
        (first, torch.zeros(0, T, dtype=torch.int64)),
        (middle, torch.zeros(B, T, C + 1)),
        (middle, torch.zeros(B, T, C, dtype=torch.float64)),
        (middle, torch.full((B, T, C), math.nan)),
        (middle, torch.zeros(B, T)),
    ]
    for contract, x in refused:
        with pytest.raises(RemoteError) as exc:
            contract.check_input(x)
        assert _code(exc) == ErrorCode.BAD_REQUEST, (contract.stage, x.shape, x.dtype)


def test_targets_and_output_gradients_must_match_the_input() -> None:
    last, middle = StageContract.from_spec(SPEC, 2), StageContract.from_spec(SPEC, 1)
    last.check_targets(torch.randint(0, 256, (2, 5)), 2, 5)
    for targets in (torch.randint(0, 256, (2, 4)), torch.zeros(2, 5), torch.full((2, 5), 300)):
        with pytest.raises(RemoteError):
            last.check_targets(targets, 2, 5)
    middle.check_output_grad(torch.zeros(2, 5, 16), 2, 5)
    middle.check_output_grad(torch.zeros(2, 5, 16), None, None)  # input not known yet
    for grad in (torch.zeros(2, 4, 16), torch.zeros(2, 5, 8), torch.full((2, 5, 16), math.inf)):
        with pytest.raises(RemoteError):
            middle.check_output_grad(grad, 2, 5)


def test_contract_knows_first_and_last_stages() -> None:
    assert StageContract.from_spec(SPEC, 0).first and not StageContract.from_spec(SPEC, 0).last
    assert StageContract.from_spec(SPEC, 2).last
    with pytest.raises(ValueError, match="out of range"):
        StageContract.from_spec(SPEC, 3)


def _received(t: torch.Tensor, codec: str = "int8/b64/f32") -> ReceivedTensor:
    return ReceivedTensor.of(encode(t, CodecSpec.from_wire(codec)))


def test_relayed_reply_tensors_are_checked_against_their_headers() -> None:
    good = _received(torch.ones(2, 3))
    assert check_relayed([good], (2, 3), torch.float32, "y") is good
    wrong: list[list[object]] = [
        [], [good, good], [_received(torch.ones(3, 2))],
        [_received(torch.ones(2, 3, dtype=torch.float64), "none")],
        [torch.ones(2, 3)],  # a decoded tensor is not one to relay
    ]
    for tensors in wrong:
        with pytest.raises(BadReply):
            check_relayed(tensors, (2, 3), torch.float32, "y")
    # values are not looked at: they are checked where the payload is decoded
    nan = _received(torch.full((2, 3), math.nan), "none")
    assert check_relayed([nan], (2, 3), torch.float32, "y") is nan and not nan.is_decoded


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(
    header=st.one_of(
        _json,
        st.fixed_dictionaries(
            {
                "hop": st.dictionaries(
                    st.sampled_from(["run_id", "trainer", "micro_batch", "stage", "attempt"]), _json
                )
            },
            optional={"budget_s": _json, "v": _json, "input_carried": _json, "keep_input": _json},
        ),
    )
)
def test_random_headers_only_ever_raise_bad_request(header: Any) -> None:
    for model in (
        ForwardRequest,
        ForwardLossRequest,
        BackwardRequest,
        EvalLossRequest,
        InfoRequest,
    ):
        try:
            parse_request(model, header)
        except RemoteError as exc:
            assert exc.code == ErrorCode.BAD_REQUEST
    for reply in (ForwardReply, LossReply, BackwardReply, InfoReply):
        try:
            parse_reply(reply, header)
        except BadReply:
            pass
