"""End to end through the public gRPC API: real Ray workers, real KV transfer, real model.

Both modes must give the engine core's (and so Hugging Face's) greedy tokens, and
every request must leave both workers' block pools as it found them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from tandem.v1 import tandem_pb2 as pb

from .conftest import cancel_after

pytestmark = pytest.mark.slow

NUM_TOKENS = 24


def greedy_req(ids=None, prompt=None, chat=None, max_tokens=NUM_TOKENS, stream=True, **kw):
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    if ids is not None:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sp, stream=stream)
    if chat is not None:
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content=chat)]), sampling=sp, stream=stream)
    return pb.GenerateRequest(prompt=prompt, sampling=sp, stream=stream)


def token_ids_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.fixture(scope="module")
def parity(tokenizer, hf_greedy):
    from tests.test_engine_parity import parity_prompts

    prompts = parity_prompts(tokenizer)
    return prompts, [hf_greedy(p, NUM_TOKENS) for p in prompts]


@pytest.mark.parametrize("mode", ["disagg", "coloc"])
def test_greedy_parity_over_grpc(mode, request, parity):
    client = request.getfixturevalue(mode)
    prompts, reference = parity
    if mode == "coloc":     # the colocated engine path is held to these tokens offline too
        keep = [0, 4, 5, 7]    # (test_engine_parity): short chat and raw prompts, the longest
        prompts, reference = [prompts[i] for i in keep], [reference[i] for i in keep]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: client.generate(greedy_req(ids=p)), prompts))
    for i, (resp, ref) in enumerate(zip(outs, reference)):
        assert token_ids_of(resp) == ref, f"prompt {i}"
        final = resp[-1]
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.prompt_tokens == len(prompts[i])
        assert final.usage.completion_tokens == NUM_TOKENS
    counts = client.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values()), counts


def test_a_full_prefill_queue_sends_prompts_to_their_decode_worker(disagg, parity):
    """Conditional disaggregation (``max_prefill_queue_tokens``): prompts that arrive
    while the prefill worker has that many tokens in flight are prefilled on their
    decode worker; both kinds give the reference's greedy tokens and leave no block."""
    prompts, reference = parity
    orchestrator = disagg.server.server.orchestrator
    barrier = threading.Barrier(len(prompts))

    def run(p):
        barrier.wait()
        return disagg.generate(greedy_req(ids=p))
    local = remote = 0
    orchestrator.max_prefill_queue_tokens = 1      # anything in flight: prefill locally
    try:
        for _ in range(3):      # all at once: every prompt after the first finds one in flight
            text = disagg.metrics_text()
            local0 = _counter(text, "tandem:local_prefills_total")
            remote0 = _counter(text, "tandem:kv_transfer_seconds_count")
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(run, prompts))
            for i, (resp, ref) in enumerate(zip(outs, reference)):
                assert token_ids_of(resp) == ref, f"prompt {i}"
            text = disagg.metrics_text()
            local = _counter(text, "tandem:local_prefills_total") - local0
            remote = _counter(text, "tandem:kv_transfer_seconds_count") - remote0
            assert local + remote == len(prompts), (local, remote)
            if local:
                break
    finally:
        orchestrator.max_prefill_queue_tokens = None
    assert local >= 1 and remote >= 1, (local, remote)
    counts = disagg.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values()), counts
    # Unset again: the next prompt goes to the prefill worker.
    before = _counter(disagg.metrics_text(), "tandem:local_prefills_total")
    assert token_ids_of(disagg.generate(greedy_req(ids=prompts[0]))) == reference[0]
    assert _counter(disagg.metrics_text(), "tandem:local_prefills_total") == before


def test_prefer_local_prefill_keeps_prompts_off_a_busy_decode_worker_unless_cached(
        disagg, tokenizer, hf_greedy):
    """``prefer_local_prefill``: a prompt that finds its decode worker with no
    decode batch is prefilled there (no KV transfer); one that arrives while it
    decodes goes to the prefill worker, unless the decode worker's prefix cache
    holds it already. Every answer is the reference's; no block is left."""
    fresh = [tokenizer.encode(f"Prompt {i}: a short note on {topic}, seen by no other test.")
             for i, topic in enumerate(["rivers", "glaciers"])]
    reference = [hf_greedy(p, NUM_TOKENS) for p in fresh]
    server = disagg.server.server
    orchestrator, decode = server.orchestrator, server.cluster.decode[0]
    metric = ("tandem:local_prefills_total", "tandem:kv_transfer_seconds_count")

    def counts():
        text = disagg.metrics_text()
        return [_counter(text, name) for name in metric]
    orchestrator.prefer_local_prefill = True
    stream = None
    try:
        disagg.wait_idle()
        local0, remote0 = counts()
        assert token_ids_of(disagg.generate(greedy_req(ids=fresh[0]))) == reference[0]
        assert counts() == [local0 + 1, remote0]           # alone: on its decode worker
        deadline = time.monotonic() + 30                    # its KV events reach the router
        while not orchestrator._cached_on(decode, fresh[0]):
            assert time.monotonic() < deadline, "the decode worker's KV events never came"
            time.sleep(0.05)
        # A long answer decodes (its first token is out): a decode batch from now on.
        stream = disagg.stub.Generate(greedy_req(ids=fresh[0], max_tokens=256), timeout=120)
        first = [next(stream)]
        while not first[-1].token_ids:
            first.append(next(stream))
        assert counts() == [local0 + 2, remote0]
        # An uncached prompt goes to the prefill worker; the cached one stays.
        assert token_ids_of(disagg.generate(greedy_req(ids=fresh[1]))) == reference[1]
        assert counts() == [local0 + 2, remote0 + 1]
        assert token_ids_of(disagg.generate(greedy_req(ids=fresh[0]))) == reference[0]
        assert counts() == [local0 + 3, remote0 + 1]
        got = token_ids_of([*first, next(stream)])
        assert got == reference[0][:len(got)]
    finally:
        orchestrator.prefer_local_prefill = False
        if stream is not None:
            stream.cancel()                     # an abort frees its blocks too
    counts_after = disagg.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts_after.values())


def test_prefer_local_prefill_shares_prompts_with_a_busy_prefill_worker(
        disagg, tokenizer, hf_greedy):
    """``prefer_local_prefill``: a prompt that arrives while the decode worker only
    waits for another prompt's KV cache (no decode batch) and the prefill worker
    computes that one, is prefilled on the decode worker, not queued behind it.
    Both answers are the reference's; the router's in-flight counts return to zero."""
    import concurrent.futures

    sent_away = tokenizer.encode("A long note on tides, read by no other test. " * 40)
    kept = tokenizer.encode("A short note on moss, read by no other test.")
    reference = [hf_greedy(p, NUM_TOKENS) for p in (sent_away, kept)]
    server = disagg.server.server
    orchestrator = server.orchestrator
    prefill, decode = server.cluster.prefill[0], server.cluster.decode[0]
    metric = ("tandem:local_prefills_total", "tandem:kv_transfer_seconds_count")

    def counts():
        text = disagg.metrics_text()
        return [_counter(text, name) for name in metric]
    disagg.wait_idle()
    local0, remote0 = counts()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            # Sent away while the rule is off (an idle decode worker would keep it).
            first = pool.submit(disagg.generate, greedy_req(ids=sent_away))
            deadline = time.monotonic() + 30
            while not prefill.inflight_prefill_tokens:
                assert time.monotonic() < deadline and not first.done(), "never sent away"
                time.sleep(0.002)
            orchestrator.prefer_local_prefill = True
            second = pool.submit(disagg.generate, greedy_req(ids=kept))
            assert token_ids_of(second.result(120)) == reference[1]
            assert token_ids_of(first.result(120)) == reference[0]
        finally:
            orchestrator.prefer_local_prefill = False
    assert counts() == [local0 + 1, remote0 + 1]
    counts_after = disagg.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts_after.values())
    assert (decode.inflight_remote_prefills, decode.inflight_local_prefills,
            decode.inflight_prefill_tokens, prefill.inflight_prefill_tokens) == (0, 0, 0, 0)


def test_prefill_kv_really_moved(disagg, tokenizer):
    counts = disagg.block_counts()
    before, decode_before = counts["prefill-0"]["kv_transfer_bytes"], counts["decode-0"]
    prefill_before = counts["prefill-0"]
    ids = tokenizer.encode("Tell me about the moon. " * 6)
    disagg.generate(greedy_req(ids=ids, max_tokens=4))
    counts = disagg.block_counts()
    after, decode_after = counts["prefill-0"]["kv_transfer_bytes"], counts["decode-0"]
    # 30 layers x K,V x 16 tokens x 3 heads x 64 dims x 4 bytes per block, fp32.
    per_block = 30 * 2 * 16 * 3 * 64 * 4
    assert (after - before) % per_block == 0 and after - before >= per_block
    # The first token reached the decode worker on the KV channel, not from the router.
    assert decode_after["first_tokens_from_peer"] == decode_before["first_tokens_from_peer"] + 1
    assert decode_after["first_tokens_from_router"] == decode_before["first_tokens_from_router"]
    # The request reached both workers on their output streams, not by Ray call
    # (the first token came back as the prefill worker's answer there).
    assert decode_after["adds_from_stream"] == decode_before["adds_from_stream"] + 1
    assert (counts["prefill-0"]["prefills_from_stream"]
            == prefill_before["prefills_from_stream"] + 1)


def test_sixteen_concurrent_streams(disagg, tokenizer):
    prompts = [tokenizer.encode(f"Count from {i} to {i + 20}:") for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: disagg.generate(greedy_req(ids=p, max_tokens=16)), prompts))
    for resp in outs:
        assert len(token_ids_of(resp)) == 16
        assert resp[-1].finish_reason == pb.FINISH_REASON_LENGTH
    disagg.wait_idle()
    # The tokens came pushed on each worker's output stream (one per router), not
    # by poll calls (engine/runtime/output_stream.py).
    infos = [disagg.server.run(w.actor.info.remote()) for w in disagg.workers()]
    assert [i["output_streams"] for i in infos] == [1] * len(infos)


def _histogram(text: str, name: str, **labels) -> tuple[float, float]:
    """``(sum, count)`` of a histogram in a ``/metrics`` scrape (labels: a subset)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if all(smp.labels.get(k) == v for k, v in labels.items()):
                if smp.name == name + "_sum":
                    total += smp.value
                elif smp.name == name + "_count":
                    count += smp.value
    return total, count


def test_the_serving_path_adds_little_to_a_decode_step(disagg, tokenizer):
    """Coarse, and both sides from the same run: at a steady batch of 4 streams the
    p50 gap between a stream's tokens as this client receives them is between 0.5x
    and 1.5x the decode worker's mean step (``engine_step_seconds``: not slower, and
    not delivered in bursts), and a step's outputs reach the router
    (``step_delivery_seconds``) within half a step on average. The close bound
    (1.15x of an offline step) is measured in benchmarks/serving_overhead.py."""
    before = disagg.metrics_text()
    prompts = [tokenizer.encode(f"Write a long story about the number {i}.") for i in range(4)]

    def arrivals(ids):
        times = []
        for r in disagg.stub.Generate(greedy_req(ids=ids, max_tokens=48), timeout=120):
            times += [time.perf_counter()] * len(r.token_ids)
        return times

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = list(pool.map(arrivals, prompts))
    assert [len(t) for t in streams] == [48] * 4
    after = disagg.metrics_text()
    # Gaps while all 4 decode: from the last stream's first token to the first one's end.
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    gaps = sorted(b - a for t in streams for a, b in zip(t, t[1:]) if a >= start and b <= end)
    assert len(gaps) > 40
    mean = {}
    for name in ("tandem:engine_step_seconds", "tandem:step_delivery_seconds"):
        (s0, c0), (s1, c1) = (_histogram(x, name, worker="decode-0") for x in (before, after))
        assert c1 > c0, name
        mean[name] = (s1 - s0) / (c1 - c0)
    step, p50 = mean["tandem:engine_step_seconds"], gaps[len(gaps) // 2]
    msg = (f"p50 gap {p50 * 1e3:.1f} ms, step {step * 1e3:.1f} ms, delivery "
           f"{mean['tandem:step_delivery_seconds'] * 1e3:.1f} ms")
    assert 0.5 * step < p50 < 1.5 * step, msg
    assert mean["tandem:step_delivery_seconds"] < 0.5 * step, msg
    disagg.wait_idle()


def test_modes_agree_on_chat_text(disagg, coloc):
    req = greedy_req(chat="Name three planets.", max_tokens=20)
    a, b = disagg.generate(req), coloc.generate(req)
    assert "".join(r.text for r in a) == "".join(r.text for r in b)
    assert token_ids_of(a) == token_ids_of(b)


def test_model_info_health_reflection(disagg):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    info = disagg.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_name, info.block_size, info.dtype, info.vocab_size) == \
        ("SmolLM2-135M-Instruct", 16, "float32", 49152)
    assert info.max_model_len == 8192
    health = health_pb2_grpc.HealthStub(disagg.channel)
    for service in ("", "tandem.v1.Tandem"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(disagg.channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("mode", ["disagg", "coloc"])
def test_c03_stop_string_spanning_tokens(mode, request):
    client = request.getfixturevalue(mode)
    # Only the text up to the stop string's end (character 17) is compared below.
    base = client.generate(greedy_req(prompt="A B C D E F G H I J K", max_tokens=20, stream=False))
    text = base[0].text
    assert len(text) >= 17, text
    stop = text[10:17]
    for stream in (True, False):
        resp = client.generate(greedy_req(prompt="A B C D E F G H I J K", max_tokens=128,
                                          stream=stream, stop=[stop]))
        got = "".join(r.text for r in resp)
        assert got == text[:text.index(stop)]
        assert resp[-1].finish_reason == pb.FINISH_REASON_STOP and resp[-1].stop_str == stop
    incl = client.generate(greedy_req(prompt="A B C D E F G H I J K", max_tokens=128, stop=[stop],
                                      include_stop_str_in_output=True))
    assert "".join(r.text for r in incl) == text[:text.index(stop) + len(stop)]
    client.wait_idle()


def test_c04_several_stop_strings_streamed(disagg):
    req = dict(prompt="Alice: Hi, Bob!\nBob: Hi,", max_tokens=8)
    plain = disagg.generate(greedy_req(**req, stream=False, stop=["\n", "Alice:"]))[0]
    streamed = disagg.generate(greedy_req(**req, stream=True, stop=["\n", "Alice:"]))
    assert "".join(r.text for r in streamed) == plain.text
    assert streamed[-1].finish_reason == plain.finish_reason
    # Without stop strings, the held-back text is all released (nothing dropped).
    nostop = disagg.generate(greedy_req(**req, stream=False))[0].text
    cut = min((nostop.index(s) for s in ("\n", "Alice:") if s in nostop), default=len(nostop))
    assert plain.text == nostop[:cut]
    disagg.wait_idle()


def test_c07_multibyte_utf8_stream(disagg, tokenizer):
    s = "你好，世界 🎉👍🏽🇯🇵"
    req = greedy_req(prompt=f"Repeat after me: {s}\nRepeat after me: {s}\nRepeat after me:",
                     max_tokens=30)
    streamed = disagg.generate(req)
    assert all("\ufffd" not in r.text for r in streamed)
    text = "".join(r.text for r in streamed)
    req.stream = False
    assert text == disagg.generate(req)[0].text
    assert text == tokenizer.decode(token_ids_of(streamed))
    assert s in text      # Chinese, emoji with a skin-tone modifier and a flag came through whole


def test_answer_cut_inside_a_character_ends_at_the_last_whole_one(disagg, tokenizer):
    # max_tokens ends the answer after two of 👍's four bytes: decode would show U+FFFD.
    answer = "你好，世界 🎉👍🏽🇯🇵\n你好，世界 🎉"
    prompt = "你好，世界 🎉👍🏽🇯🇵\n" * 6
    # Streamed, and (batched with it) not streamed with a stop string that holds
    # back the final "🎉" until the end: the same text.
    reqs = [greedy_req(prompt=prompt, max_tokens=40),
            greedy_req(prompt=prompt, max_tokens=40, stream=False, stop=["🎉!"])]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed, [whole] = pool.map(disagg.generate, reqs)
    assert all("\ufffd" not in r.text for r in streamed)
    assert "".join(r.text for r in streamed) == answer
    assert tokenizer.decode(token_ids_of(streamed)) == answer + "\ufffd"
    assert (whole.text, list(whole.token_ids)) == (answer, token_ids_of(streamed))
    for final in (streamed[-1], whole):
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 40


def test_c08_spaces_in_streamed_text(coloc, tokenizer):
    req = greedy_req(chat="Write one sentence about the ocean.", max_tokens=30)
    streamed = coloc.generate(req)
    text = "".join(r.text for r in streamed)
    req.stream = False
    assert text == coloc.generate(req)[0].text == tokenizer.decode(token_ids_of(streamed))
    assert text.count(" ") >= 3


@pytest.mark.parametrize("mode", ["disagg", "coloc"])
def test_c10_client_disconnect_aborts(mode, request):
    client = request.getfixturevalue(mode)
    baseline = client.wait_idle()
    aborts_before = _counter(client.metrics_text(), "tandem:request_aborts_total")
    call = client.stub.Generate(greedy_req(prompt="Tell me a very long story.", max_tokens=4096))
    cancel_after(call, 1.0)
    got = 0
    with pytest.raises(grpc.RpcError) as err:
        for r in call:
            got += len(r.token_ids)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert got > 0
    t0 = time.monotonic()
    after = client.wait_idle(10)
    assert time.monotonic() - t0 < 5
    for wid, c in after.items():
        assert c["num_running"] == 0 and c["num_free_blocks"] == baseline[wid]["num_blocks"], (wid, c)
    deadline = time.monotonic() + 5
    while _counter(client.metrics_text(), "tandem:request_aborts_total") < aborts_before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_c11_non_streaming_cancel_repeated(disagg):
    for _ in range(100):
        call = disagg.stub.Generate(greedy_req(prompt="Write an endless poem.", max_tokens=2000,
                                               stream=False))
        cancel_after(call, 0.05)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    counts = disagg.wait_idle(30)
    for c in counts.values():
        assert c["num_running"] == 0 and c["num_waiting"] == 0
        assert c["num_free_blocks"] == c["num_blocks"]
    # Still serving.
    assert len(token_ids_of(disagg.generate(greedy_req(prompt="Hi", max_tokens=3)))) == 3


@pytest.mark.parametrize("req,field", [
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[])), "chat.messages"),
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_k=-5)), "sampling.top_k"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), "token_ids.ids[1]"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=9000)), "sampling.max_tokens"),
])
def test_c12_bad_input_invalid_argument_then_serves(disagg, req, field):
    with pytest.raises(grpc.RpcError) as err:
        disagg.generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    ok = disagg.generate(greedy_req(prompt="Hello", max_tokens=2))
    assert len(token_ids_of(ok)) == 2


def test_c12_empty_user_message_generates(disagg):
    resp = disagg.generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="")]),
        sampling=pb.SamplingParams(max_tokens=4, temperature=0)))
    assert 1 <= len(token_ids_of(resp)) <= 4
    disagg.wait_idle()


def test_max_tokens_one_and_eos_first(disagg):
    resp = disagg.generate(greedy_req(prompt="Hello world, ", max_tokens=1))
    assert len(token_ids_of(resp)) == 1 and resp[-1].finish_reason == pb.FINISH_REASON_LENGTH
    disagg.wait_idle()


def test_n_samples_and_logprobs_over_grpc(disagg):
    req = pb.GenerateRequest(prompt="My favourite colour is", stream=False, sampling=pb.SamplingParams(
        n=3, max_tokens=5, temperature=1.0, seed=5, ignore_eos=True, logprobs=2))
    resp = disagg.generate(req)
    assert sorted(r.index for r in resp) == [0, 1, 2]
    for r in resp:
        assert len(r.token_ids) == 5 and len(r.logprobs) == 5
        assert all(len(lp.top_logprobs) == 2 for lp in r.logprobs)
    assert resp == disagg.generate(req) or \
        sorted((r.index, tuple(r.token_ids)) for r in resp) == \
        sorted((r.index, tuple(r.token_ids)) for r in disagg.generate(req))
    disagg.wait_idle()


def test_seeded_sampling_same_in_both_modes(disagg, coloc):
    req = pb.GenerateRequest(prompt="Once upon a time", stream=True, sampling=pb.SamplingParams(
        max_tokens=12, temperature=0.9, seed=1234, ignore_eos=True))
    assert token_ids_of(disagg.generate(req)) == token_ids_of(coloc.generate(req))


def _counter(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


@pytest.fixture(scope="module")
def offline_prompt_logprobs(f32_weights, tokenizer):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    ids = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    llm = LLM(dtype="float32", num_blocks=16, weights_from=f32_weights)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                             prompt_logprobs=2))[0]
    return ids, out


@pytest.mark.parametrize("mode", ["disagg", "coloc"])
def test_prompt_logprobs_over_grpc_equal_the_offline_engines(mode, request,
                                                             offline_prompt_logprobs):
    client = request.getfixturevalue(mode)
    ids, want = offline_prompt_logprobs
    moved = lambda: {wid: c.get("kv_transfer_bytes") for wid, c in client.block_counts().items()}
    before = moved()
    resp = client.generate(greedy_req(ids=ids, max_tokens=2, prompt_logprobs=2))
    assert token_ids_of(resp) == want.outputs[0].token_ids
    first = resp[0].prompt_logprobs
    assert [p.token_id for p in first] == ids
    assert not first[0].HasField("logprob") and not first[0].top_logprobs
    for p, (got, exp) in enumerate(zip(first[1:], want.prompt_logprobs[1:]), start=1):
        assert abs(got.logprob - exp.logprob) <= 1e-4, p
        assert [t.token_id for t in got.top_logprobs] == [t for t, _ in exp.top], p
        assert all(abs(t.logprob - v) <= 1e-4 for t, (_, v) in zip(got.top_logprobs, exp.top))
    assert all(not r.prompt_logprobs for r in resp[1:])
    # Disaggregated, the decode worker prefilled it: no KV moved.
    assert moved() == before
    counts = client.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values()), counts


def test_beam_search_over_grpc_equals_offline(disagg, f32_weights):
    """``use_beam_search`` on a disaggregated cluster: the decode worker runs the whole
    search (no KV moves); the n responses are the offline beams, best first; every
    block is free again afterwards."""
    from tandem.engine.llm import LLM
    from tandem.engine.runtime.beam_search import BeamSearchParams

    prompts = ["The capital of France is", "def fib(n):"]
    llm = LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
    want = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=10,
                                                     length_penalty=0.5))
    moved = lambda: {wid: c.get("kv_transfer_bytes") for wid, c in disagg.block_counts().items()}
    before = moved()
    for prompt, exp in zip(prompts, want):
        resp = disagg.generate(pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            n=4, max_tokens=10, use_beam_search=True, length_penalty=0.5)))
        assert sorted(r.index for r in resp) == [0, 1, 2, 3]
        by_index = {r.index: r for r in resp}
        assert [list(by_index[i].token_ids) for i in range(4)] == \
            [s.output_token_ids for s in exp.sequences]
        assert [by_index[i].text for i in range(4)] == [s.text for s in exp.sequences]
    assert moved() == before
    counts = disagg.wait_idle()
    assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values()), counts
    with pytest.raises(grpc.RpcError) as e:
        disagg.generate(pb.GenerateRequest(prompt="hi", stream=True, sampling=pb.SamplingParams(
            n=4, use_beam_search=True)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream" in e.value.details()


def test_disaggregated_workers_lending_idle_cores_serve_the_same_tokens(ray_session, parity):
    """``lend_idle_cores``: the workers are not pinned, each marks its slot on the
    core board while it computes; tokens equal the reference under concurrency,
    every slot is idle once the requests are done, and the board's file goes with
    the server."""
    import os

    from .conftest import Client, serve_config, start_server

    # Its own namespace: the module's other clusters run in the same Ray session.
    server = start_server(serve_config("disaggregated", lend_idle_cores=True,
                                       namespace="tandem-lending"))
    client = Client(server)
    try:
        board = server.server.core_board
        with open(board, "rb") as f:
            assert f.read() == b"\x00\x00"         # decode-0, prefill-0
        cores = sorted(os.sched_getaffinity(0))
        for w in client.workers():
            assert w.info["cpus"] == cores           # not pinned
        prompts, reference = parity
        # All eight prompts are held to these tokens on the pinned cluster
        # (test_greedy_parity_over_grpc[disagg]); what lending changes is the cores
        # each worker steps on, its own share plus the idle one's. Short chat and raw
        # prompts beside the longest, whose prefill keeps the prefill worker busy
        # while the decode worker starts on the others.
        keep = [0, 4, 5, 7]
        prompts, reference = [prompts[i] for i in keep], [reference[i] for i in keep]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: client.generate(greedy_req(ids=p)), prompts))
        for i, (resp, ref) in zip(keep, zip(outs, reference)):
            assert token_ids_of(resp) == ref, f"prompt {i}"
        counts = client.wait_idle()
        assert all(c["num_free_blocks"] == c["num_blocks"] for c in counts.values()), counts
        deadline = time.monotonic() + 10
        while True:                 # each loop marks itself idle before it waits
            with open(board, "rb") as f:
                if f.read() == b"\x00\x00":
                    break
            assert time.monotonic() < deadline, "a worker stayed marked busy"
            time.sleep(0.05)
    finally:
        client.close()
        server.stop()
    assert not os.path.exists(board)
