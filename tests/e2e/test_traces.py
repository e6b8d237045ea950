"""Through the tinker SDK, on the session cluster (which exports its traces to a receiver the tests run on
loopback, ``conftest.trace_receiver``): one request is one trace across the ingress, the futures DB and the
trainer; a pass of two models is linked to both requests; saves and samples are traced on the trainer too."""

import numpy as np
from tinker import types

from helpers import two_on_one_trainer, unload_models

FORWARD_BACKWARD = "POST /api/v1/forward_backward"


def datum(seed: int) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(0, 1000, 33).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 32})


def ingress_spans(spans, route: str, model_id: str):
    return [s for s in spans if s.service == "lilo-ingress" and s.name == route
            and s.attributes.get("lilo.model_id") == model_id]


def in_trace(spans, root):
    return [s for s in spans if s.trace_id == root.trace_id]


def test_a_forward_backward_is_one_trace_from_the_ingress_through_the_futures_db_to_the_trainer(
        service, local_cluster, trace_receiver):
    client = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
    try:
        client.forward_backward([datum(1)], "cross_entropy").result(timeout=120)

        def complete(spans):
            roots = ingress_spans(spans, FORWARD_BACKWARD, client.model_id)
            return roots and {"futures.complete", "trainer.execute"} <= {s.name for s in in_trace(spans, roots[0])}

        spans = trace_receiver.wait_for(complete)
        (root,) = ingress_spans(spans, FORWARD_BACKWARD, client.model_id)
        assert root.attributes["http.response.status_code"] == 200 and root.attributes["lilo.tenant"] == "local"
        assert root.attributes["http.route"] == "/api/v1/forward_backward" and root.parent_span_id == ""
        request_id = root.attributes["lilo.request_id"]
        trace = {(s.service, s.name): s for s in in_trace(spans, root)}
        assert {("lilo-futures", "futures.record"), ("lilo-futures", "futures.complete"),
                ("lilo-trainer", "trainer.queue_wait"), ("lilo-trainer", "trainer.execute")} <= set(trace), trace
        for part in ("futures.record", "trainer.queue_wait", "trainer.execute"):
            span = next(s for (_, name), s in trace.items() if name == part)
            assert span.parent_span_id == root.span_id and str(span.attributes["lilo.request_id"]) == str(request_id)
        execute = trace[("lilo-trainer", "trainer.execute")]
        assert trace[("lilo-trainer", "trainer.queue_wait")].end_ns == execute.start_ns
        assert root.start_ns <= trace[("lilo-futures", "futures.record")].start_ns <= execute.start_ns
    finally:
        unload_models(local_cluster.api_url, [client.model_id])


def test_a_pass_of_two_models_is_linked_to_both_requests(service, local_cluster, ray_driver, trace_receiver):
    created = [service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
               for _ in range(3)]
    clients = two_on_one_trainer(created)
    try:
        shared = []
        for attempt in range(6):  # sent together, the two usually share a pass: it is the pass that is checked
            futures = [client.forward_backward([datum(attempt)], "cross_entropy") for client in clients]
            [future.result(timeout=120) for future in futures]

            def linked(spans):
                roots = [{(s.trace_id, s.span_id) for s in ingress_spans(spans, FORWARD_BACKWARD, c.model_id)}
                         for c in clients]
                return [s for s in spans if s.name == "trainer.pass forward_backward"
                        and all(set(s.links) & ids for ids in roots)]

            shared = linked(trace_receiver.wait_for(linked, timeout_s=10))
            if shared:
                break
        assert shared, "no pass held both clients' forward_backward in 6 tries"
        assert shared[0].attributes["lilo.models"] == 2 and shared[0].attributes["lilo.requests"] == 2
        assert shared[0].attributes["lilo.tokens"] == 2 * 32
    finally:
        unload_models(local_cluster.api_url, [client.model_id for client in created])


def test_a_save_and_a_sample_are_traced_on_the_trainer(service, local_cluster, trace_receiver):
    client = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
    try:
        sampler = client.save_weights_and_get_sampling_client()
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1,
                       types.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=120)

        def traced(spans):
            saves = ingress_spans(spans, "POST /api/v1/save_weights_for_sampler", client.model_id)
            samples = [s for s in spans if s.service == "lilo-ingress" and s.name == "POST /api/v1/asample"
                       and client.model_id in str(s.attributes.get("lilo.model_id"))]
            return (saves and samples
                    and {"trainer.capture", "trainer.persist"} <= {s.name for s in in_trace(spans, saves[0])}
                    and "trainer.execute" in {s.name for s in in_trace(spans, samples[-1])})

        assert traced(trace_receiver.wait_for(traced)), "the save's or the sample's trainer spans never came"
    finally:
        unload_models(local_cluster.api_url, [client.model_id])
