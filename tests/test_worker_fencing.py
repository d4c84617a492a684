"""Worker self-fencing: a fenced worker refuses new work with WorkerFencedError (which
reaches the router as itself) and keeps running what it has."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from tandem.engine.runtime.outputs import WorkerRequest
from tandem.engine.runtime.worker_common import WorkerFencedError
from tandem.engine.sampling.sampling_params import SamplingParams
from tandem.router.worker_client import TYPED_ERRORS, call_worker


def test_the_error_names_worker_and_reason_and_survives_pickling():
    err = WorkerFencedError("decode-1", "lease lost")
    assert isinstance(err, RuntimeError) and WorkerFencedError in TYPED_ERRORS
    assert str(err) == "worker decode-1 is fenced: lease lost"
    back = pickle.loads(pickle.dumps(err))          # how it crosses Ray
    assert (type(back), back.worker_id, back.reason, str(back)) == \
        (WorkerFencedError, "decode-1", "lease lost", str(err))


@pytest.fixture(scope="module")
def config():
    from tandem.engine.config import CacheConfig, EngineConfig

    return EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64))


@pytest.mark.slow
def test_a_fenced_decode_worker_refuses_new_requests_and_finishes_its_own(config, f32_weights):
    from tandem.decode_worker.worker import DecodeWorker

    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def scenario():
        worker = DecodeWorker("colocated-0", config, role="colocated", kv_transport=None,
                              weights_from=f32_weights.engine)
        try:
            await worker.add_request(WorkerRequest("r1", (1, 2, 3, 4), long))
            await worker.fence("lease lost")
            with pytest.raises(WorkerFencedError) as err:
                await call_worker("colocated-0", worker, "add_request",
                                  WorkerRequest("r2", (1, 2, 3), long))
            assert (err.value.worker_id, err.value.reason) == ("colocated-0", "lease lost")
            finished, tokens = None, 0
            while finished is None:
                for step in await worker.poll(1.0):
                    for d in step.deltas:
                        assert d.request_id == "r1"
                        tokens += len(d.new_token_ids)
                        finished = d.finish_reason or finished
            assert (finished, tokens) == ("length", 24)
            await worker.unfence()
            await worker.add_request(WorkerRequest("r3", (1, 2, 3), long))
            assert await worker.abort("r3")
            return await worker.check_invariants()
        finally:
            await worker.shutdown()

    counts = asyncio.run(scenario())
    assert counts["num_free_blocks"] == counts["num_blocks"]


@pytest.mark.slow
def test_a_fenced_prefill_worker_refuses_prefills(config, f32_weights):
    from tandem.prefill_worker.worker import PrefillWorker

    async def scenario():
        worker = PrefillWorker("prefill-0", config, weights_from=f32_weights.engine)
        try:
            await worker.fence("superseded by generation 4")
            with pytest.raises(WorkerFencedError, match="superseded by generation 4"):
                await call_worker("prefill-0", worker, "prefill",
                                  WorkerRequest("p1", (1, 2, 3), SamplingParams(max_tokens=4)))
            await worker.unfence()
            return await worker.check_invariants()
        finally:
            await worker.shutdown()

    counts = asyncio.run(scenario())
    assert counts["num_free_blocks"] == counts["num_blocks"] and counts["num_waiting"] == 0
