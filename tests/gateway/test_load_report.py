"""``health.load_report``: a replica's figures read from vLLM's and SGLang's expositions."""

from __future__ import annotations

import pytest

from gateway.health.load_report import figures, report

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
vllm:num_requests_running_total{engine="0"} 99
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 12.0
"""

SGLANG = """\
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
"""


def test_vllms_and_sglangs_names_are_read() -> None:
    assert figures(VLLM, "vllm") == (3.0, 7.0, 0.42)
    assert figures(SGLANG, "sglang") == (2.0, 5.0, 0.28)
    assert figures(VLLM, "sglang") is None


def test_vllm_v0s_cache_name_is_read_too() -> None:
    v0 = VLLM.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert figures(v0, "vllm") == (3.0, 7.0, 0.42)


def test_series_are_summed_and_the_cache_share_is_the_largest() -> None:
    text = VLLM + (
        'vllm:num_requests_running{engine="1",model_name="x"} 1\n'
        'vllm:num_requests_waiting{engine="1",model_name="x"} 4 1700000000000\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="x"} 0.9\n'
    )
    assert figures(text, "vllm") == (7.0, 8.0, 0.9)


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_running{model_name="a } b",x="q\\"}"} 7',  # quoted braces, escapes
        "vllm:num_requests_running 7",  # no labels
        "vllm:num_requests_running\t7.0e0 123",  # a tab; a timestamp
    ],
)
def test_labels_are_skipped_as_quoted(line: str) -> None:
    text = "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n" + line + "\n"
    assert figures(text, "vllm") == (0.0, 7.0, 0.0)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 1\n",  # no cache figure
        VLLM.replace("} 3.0", "} NaN"),
        VLLM.replace("} 3.0", "} three"),
        VLLM.replace("} 3.0", "}"),
        'vllm:num_requests_waiting{model_name="cut 3\n' + VLLM,
    ],
)
def test_a_figure_missing_or_unreadable_makes_no_report(text: str) -> None:
    assert report(text, "vllm", now=5.0, max_age=3.0) is None


def test_a_report_counts_from_now_for_max_age() -> None:
    load = report(VLLM, "vllm", now=5.0, max_age=3.0)
    assert load is not None
    assert (load.waiting, load.running, load.kv_cache, load.at, load.expires) == (
        3.0,
        7.0,
        0.42,
        5.0,
        8.0,
    )
