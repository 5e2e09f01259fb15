"""Units of the request lifecycle without a model: the shutdown drain's state machine and its
signal handling, request deadlines, structured parameter errors (`ParamError`) and the request
checks that name the field sent, the queue-time histogram."""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from scheduler.sampling_options import ParamError, check  # noqa: E402
from tokenspeed_jax.sampling_params import SamplingParams  # noqa: E402
from tokenspeed_jax.server.drain import ABORT_WAIT_S, Drain, DrainingServer  # noqa: E402
from tokenspeed_jax.server.errors import UnsupportedField  # noqa: E402
from tokenspeed_jax.server.events import Deadline, TimedOut  # noqa: E402
from tokenspeed_jax.server.metrics import ServerMetrics  # noqa: E402
from tokenspeed_jax.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _drain(grace: float, live: int) -> tuple[Drain, _Clock, list[int]]:
    clock, aborted = _Clock(), []
    d = Drain(grace, clock=clock)
    state = {"live": live}
    d.live = lambda: state["live"]
    d.abort_rest = lambda: aborted.append(state["live"]) or state["live"]
    return d, clock, aborted


def test_drain_waits_for_in_flight_requests_then_exits():
    d, clock, aborted = _drain(grace=10, live=0)
    assert not d.draining and not d.done() and not d.aborting()
    d.begin()
    assert d.draining and d.done() and not aborted  # nothing in flight: exit at once


def test_drain_aborts_what_outlives_the_grace():
    d, clock, aborted = _drain(grace=10, live=3)
    d.begin()
    assert d.draining and not d.done() and not d.aborting()
    clock.t += 9.9
    assert not d.done() and not d.aborting()  # still within the grace
    clock.t += 0.2
    assert d.aborting() and not d.done()  # handlers end their choices with "abort" now
    clock.t += ABORT_WAIT_S
    assert d.done() and aborted == [3]  # what no handler ended is aborted in the engine


def test_second_signal_skips_the_grace_third_forces_the_exit():
    d, clock, _ = _drain(grace=1e9, live=1)
    server = DrainingServer(uvicorn.Config(app=None), d)
    server.handle_exit(signal.SIGTERM, None)
    assert d.draining and not d.aborting() and not server.should_exit
    server.handle_exit(signal.SIGINT, None)
    assert d.aborting() and not server.should_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and server.force_exit
    # never recorded: uvicorn would re-raise them after shutting down (exit status 143 / 130)
    assert server._captured_signals == []


def test_refusal_is_an_openai_503():
    r = Drain(1).refusal()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert b'"code":"server_shutting_down"' in r.body and b'"param":null' in r.body


def test_deadline():
    Deadline(None).check()
    Deadline(60).check()
    with pytest.raises(TimedOut, match="--request-timeout-s"):
        Deadline(0.5, start=0.0).check()


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=2), "top_p"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logit_bias={1: 1000}), "logit_bias"),
        (dict(top_logprobs=99), "top_logprobs"),
        (dict(structured_outputs={"regex": ""}), "structured_outputs"),
    ],
)
def test_sampling_params_errors_carry_the_field(kwargs, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and isinstance(e.value, ValueError)
    assert str(e.value).startswith(
        "SamplingParams." if param != "structured_outputs" else "structured_outputs"
    )


def test_check_raises_param_error():
    with pytest.raises(ParamError) as e:
        check("seed", -1)
    assert e.value.param == "seed"


@pytest.mark.parametrize(
    "body,ids,param",
    [
        (dict(prompt="x"), [], "prompt"),
        (dict(prompt="x"), [1, 999], "prompt"),
        (dict(prompt="x", stop_token_ids=[5, 999]), [1], "stop_token_ids"),
        (dict(prompt="x", logit_bias={"999": 1}), [1], "logit_bias"),
        (dict(prompt="x", logit_bias={"a": 1}), [1], "logit_bias"),
        (dict(prompt="x", max_tokens=60), [1] * 5, "max_tokens"),
        (dict(prompt="x"), [1] * 64, "prompt"),  # no room left to generate
        (
            dict(messages=[{"role": "user", "content": "x"}], max_completion_tokens=64),
            [1],
            "max_completion_tokens",
        ),
        (dict(messages=[{"role": "user", "content": "x"}]), [], "messages"),
    ],
)
def test_request_checks_name_the_field_sent(body, ids, param):
    req = (ChatCompletionRequest if "messages" in body else CompletionRequest)(**body)
    with pytest.raises(UnsupportedField) as e:
        req.check_prompt(ids, vocab_size=256, max_context=64)
    assert e.value.field == param and param in str(e.value)


def test_request_checks_pass_and_size_the_output():
    assert CompletionRequest(prompt="x").check_prompt([1] * 10, 256, 64) == 54
    assert CompletionRequest(prompt="x", max_tokens=4).check_prompt([1] * 10, 256, 64) == 4


def test_queue_time_histogram_is_exported():
    m = ServerMetrics(lambda: [])
    m.observe_queue_time(0.02)
    m.observe_queue_time(3.0)
    text = m.render().decode()
    assert "tokenspeed_queue_time_seconds_count 2.0" in text
    assert 'tokenspeed_queue_time_seconds_bucket{le="0.025"} 1.0' in text


def test_a_state_pool_gets_its_own_page_gauges():
    """A replica with a state pool (`state_total_pages` in its stats) exports its free / total
    pages beside the shared pool's; a replica without one exports none."""
    base = dict(free_pages=90, total_pages=100)
    m = ServerMetrics(lambda: [dict(base, state_free_pages=7, state_total_pages=9), dict(base)])
    text = m.render().decode()
    assert 'tokenspeed_pages_free{replica="0"} 90.0' in text
    assert 'tokenspeed_state_pages_free{replica="0"} 7.0' in text
    assert 'tokenspeed_state_pages_total{replica="0"} 9.0' in text
    assert 'tokenspeed_state_pages_total{replica="1"}' not in text
