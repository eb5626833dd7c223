"""Drives a running `kvfleet worker` with the official `openai` Python SDK, as a user would.

Run by tests/openai_clients.rs against the worker binary serving the embedded SmolLM2:

    python3 openai_sdk_check.py --base-url http://127.0.0.1:PORT/v1 --model SmolLM2-135M-Instruct

Checks models list and retrieve, chat and completions streamed and not, the first chat chunk
arriving with its first token (not a bare role chunk before prefill), seeds (-1 included), the sampling
extras of issue 34 (min_tokens, stop_token_ids, logit_bias, penalties, include_stop_str_in_output,
logprobs and echo with prompt log-probabilities equal to tests/fixtures/smollm2_logprobs_reference.json
within its bound), every
parameter the worker refuses answered 400 naming it (a `BadRequestError`, sent through
`extra_body` as any SDK user would), type errors naming their field, roles outside OpenAI's set,
an unknown route's error JSON, request ids, and concurrent async streams. Prints one line per
check; exits 1 at the first failure and 2 when the SDK cannot be imported (a failure, not a skip:
`.ci/install-tools` installs the pinned SDK under .tools/py).
"""

import argparse
import asyncio
import json
import sys
import time
import urllib.error
import urllib.request

try:
    import openai
except ImportError as e:  # the caller turns this into a test failure
    print(f"cannot import the openai SDK ({e}); run .ci/install-tools and `source .tools/env`", file=sys.stderr)
    sys.exit(2)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]

# What the worker does not implement: each asks for something, so each must be a 400 naming it.
REFUSED_CHAT = {
    "bad_words": ["Paris"],
    "allowed_token_ids": [1, 2, 3],
    "truncate_prompt_tokens": 10,
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "structured_outputs": {"choice": ["yes", "no"]},
    "use_beam_search": True,
    "prompt_logprobs": 1,
    "length_penalty": 0.5,
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "n": 17,
    "echo": True,
    "response_format": {"type": "json_object"},
    "reasoning_effort": "low",
    "chat_template_kwargs": [1],
    "priority": 3,
    "store": True,
    "no_such_parameter": 1,
}
# Implemented parameters out of their range (issue 34): a 400 naming them too.
REFUSED_CHAT.update({
    "repetition_penalty": 0,
    "presence_penalty": 2.5,
    "frequency_penalty": -3,
    "min_p": 1.5,
    "min_tokens": 5000,
    "logit_bias": {"42": 101},
    "stop_token_ids": [10 ** 9],
    "top_logprobs": 21,
})
REFUSED_COMPLETIONS = {
    "best_of": 2,
    "suffix": " and so on",
    "logprobs": 6,
    "top_logprobs": 2,
    "guided_choice": ["a"],
    "add_special_tokens": False,
    "another_unknown_key": "x",
}

passed = 0
# Largest |worker - reference| of a log-probability: the worker runs the same dequantised weights
# in f32 (the reference in f64) over 30 layers, the generated token through the bf16 KV pool;
# measured 0.0106 on the four prompts (issue 34), bound with room for other CPUs.
fixture_bound = 0.05


def check(cond, what):
    global passed
    if not cond:
        raise AssertionError(what)
    passed += 1


def refused(call, param, what):
    """`call` must raise BadRequestError whose error names `param`."""
    try:
        call()
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"{what}: status {e.status_code}")
        check(e.param == param, f"{what}: param {e.param!r}, want {param!r} ({e.message})")
        check(e.type == "invalid_request_error", f"{what}: type {e.type!r}")
        return e
    raise AssertionError(f"{what}: accepted, want a 400 naming {param}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--fixture", help="tests/fixtures/smollm2_logprobs_reference.json")
    args = ap.parse_args()
    model = args.model
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)

    # Models.
    ids = [m.id for m in client.models.list().data]
    check(ids == [model], f"models.list: {ids}")
    check(client.models.retrieve(model).id == model, "models.retrieve")
    try:
        client.models.retrieve("gpt-4")
        raise AssertionError("models.retrieve of another model answered")
    except openai.NotFoundError as e:
        check(e.code == "model_not_found", f"models.retrieve 404 code {e.code!r}")
    print("ok models")

    # Chat, not streamed.
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    answer = r.choices[0].message.content
    check("Paris" in answer, f"chat: {answer!r}")
    check(r.id.startswith("chatcmpl-") and r.object == "chat.completion", f"chat id {r.id}")
    check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, f"chat usage {r.usage}")
    print("ok chat")

    # Chat, streamed: the first chunk with choices carries the role and the first token's text,
    # so a client stamping time to first token on it measures the prefill. A prompt of some 200
    # tokens makes the prefill long enough for a bare role chunk to show.
    long_chat = [{"role": "user", "content": "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum"] * 30)
                  + ". What is the capital of France?"}]
    t0 = time.monotonic()
    first = None
    text = ""
    usage = None
    for ch in client.chat.completions.create(model=model, messages=long_chat, max_tokens=8, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            if first is None:
                first = (time.monotonic() - t0, ch)
            text += ch.choices[0].delta.content or ""
        if ch.usage is not None:
            usage = ch.usage
    at, ch = first
    delta = ch.choices[0].delta
    check(delta.role == "assistant", f"first chunk role {delta.role!r}")
    check(delta.content is not None, f"first chunk at {at:.2f} s has the role and no content: a role chunk before prefill")
    check(usage is not None and usage.prompt_tokens > 150 and usage.completion_tokens >= 1, f"stream usage {usage}")
    check(text != "", "streamed chat text")
    print(f"ok chat stream: first chunk at {at:.2f} s with {delta.content!r}")

    # Completions, not streamed and streamed: the same greedy text.
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    check("Paris" in r.choices[0].text and r.choices[0].finish_reason == "length", f"completion {r.choices[0]}")
    check(r.id.startswith("cmpl-") and r.object == "text_completion", f"completion id {r.id}")
    streamed = ""
    usage = None
    for ch in client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.choices:
            streamed += ch.choices[0].text
        if ch.usage is not None:
            usage = ch.usage
    greedy = r.choices[0].text
    check(streamed == greedy, f"streamed {streamed!r} != {greedy!r}")
    check(usage is not None and usage.completion_tokens == 6, f"completion stream usage {usage}")
    stop = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stop=["Paris"])
    check("Paris" not in stop.choices[0].text and stop.choices[0].finish_reason == "stop", f"stop {stop.choices[0]}")
    print("ok completions")

    # Seeds: equal seeds give equal samples; -1 means none and is accepted.
    sampled = [client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                         seed=7).choices[0].text for _ in range(2)]
    check(sampled[0] == sampled[1], f"seed 7 twice: {sampled}")
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=1.0, seed=-1)
    check(r.usage.completion_tokens == 4, "seed -1")
    print("ok seeds")

    # Defaults of unimplemented parameters, and fields that ask nothing, are accepted.
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, n=1, logprobs=False,
                                       presence_penalty=0, frequency_penalty=0, tool_choice="none", user="u",
                                       metadata={"team": "a"}, store=False, parallel_tool_calls=False,
                                       service_tier="auto", response_format={"type": "text"},
                                       extra_body={"top_k": -1, "ignore_eos": False, "skip_special_tokens": True,
                                                   "repetition_penalty": 1.0, "min_tokens": 0, "cache_salt": "s"})
    check(r.choices[0].finish_reason in ("stop", "length"), "defaults accepted")
    print("ok defaults")

    # The sampling extras (issue 34).
    fixture = json.load(open(args.fixture)) if args.fixture else None
    base = client.chat.completions.create(model=model, messages=CHAT, max_tokens=64, temperature=0)
    check(base.choices[0].finish_reason == "stop" and base.usage.completion_tokens < 20,
          f"baseline chat ends early: {base.usage}")
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=64, temperature=0,
                                       extra_body={"min_tokens": 20})
    check(r.usage.completion_tokens >= 20, f"min_tokens 20: {r.usage} {r.choices[0].message.content!r}")
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stop=["Paris"],
                                  extra_body={"include_stop_str_in_output": True})
    check(r.choices[0].text.endswith("Paris") and r.choices[0].finish_reason == "stop", f"include stop {r.choices[0]}")
    rep_prompt = "hello hello hello hello hello hello hello hello"
    plain = client.completions.create(model=model, prompt=rep_prompt, max_tokens=12, temperature=0).choices[0].text
    for extra in [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8}]:
        pen = client.completions.create(model=model, prompt=rep_prompt, max_tokens=12, temperature=0,
                                        **({} if "repetition_penalty" in extra else extra),
                                        extra_body=extra if "repetition_penalty" in extra else None).choices[0].text
        check(pen != plain, f"{extra} left the greedy continuation {plain!r} unchanged")
    print("ok min_tokens, include_stop_str_in_output, penalties")
    if fixture:
        paris = fixture["prompts"][0]
        ids = paris["ids"]
        greedy_id = paris["top"][-1][0][0]
        r = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0,
                                      extra_body={"stop_token_ids": [greedy_id]})
        check(r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 0,
              f"stop_token_ids [{greedy_id}]: {r.choices[0]} {r.usage}")
        r = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                      logit_bias={str(ids[1]): 100})
        check(r.choices[0].text == " capital", f"logit_bias +100 on ' capital': {r.choices[0].text!r}")
        bound = fixture_bound
        worst = 0.0
        for case in fixture["prompts"]:
            r = client.completions.create(model=model, prompt=case["ids"], max_tokens=1, temperature=0, echo=True,
                                          logprobs=5)
            lp = r.choices[0].logprobs
            n = len(case["ids"])
            check(len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None,
                  f"echo logprobs shape {lp}")
            check(r.choices[0].text.startswith(case["text"]), f"echo text {r.choices[0].text!r}")
            for got, want in zip(lp.token_logprobs[1:n], case["prompt_logprobs"]):
                worst = max(worst, abs(got - want))
            want_top = case["top"][-1]
            worst = max(worst, abs(lp.token_logprobs[n] - want_top[0][1]))
            check(len(lp.top_logprobs[n]) >= 5 and lp.text_offset[0] == 0, f"top_logprobs {lp.top_logprobs[n]}")
        check(worst <= bound, f"prompt log-probabilities differ from the reference by {worst} > {bound}")
        r = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
        check(r.usage.completion_tokens == 0 and len(r.choices[0].logprobs.token_logprobs) == len(ids),
              f"max_tokens 0 scoring {r.usage}")
        print(f"ok stop_token_ids, logit_bias, echo + logprobs: max |worker - reference| {worst:.5f} (bound {bound})")
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, f"chat logprobs entries {len(content)}")
    for e in content:
        check(e.logprob <= 0 and len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
              and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6, f"greedy chat logprobs {e}")
    streamed = []
    for ch in client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                             stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [e.logprob for e in ch.choices[0].logprobs.content]
    check(len(streamed) == len(content) and all(abs(a - b.logprob) < 1e-6 for a, b in zip(streamed, content)),
          f"streamed chat logprobs {streamed}")
    print("ok chat logprobs, streamed and not")

    # Everything else: a BadRequestError naming the parameter.
    for name, value in REFUSED_CHAT.items():
        refused(lambda: client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                                       extra_body={name: value}),
                name, f"chat {name}={value!r}")
    for name, value in REFUSED_COMPLETIONS.items():
        refused(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={name: value}),
                name, f"completions {name}={value!r}")
    print(f"ok {len(REFUSED_CHAT) + len(REFUSED_COMPLETIONS)} refused parameters")

    # n: choices sampled on their own, indexed, with log-probabilities each; usage counts the
    # prompt once and every choice's tokens.
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, n=3, seed=7, temperature=1.0,
                                       logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2], r
    assert all(c.logprobs and c.logprobs.content for c in r.choices), r
    assert 3 <= r.usage.completion_tokens <= 12, r.usage
    one = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, seed=7, temperature=1.0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens, (r.usage, one.usage)
    assert r.choices[0].message.content == one.choices[0].message.content, (r, one)
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, n=2, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs.tokens for c in r.choices), r
    print("ok n")

    # Type errors and roles name their field.
    refused(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=-1), "max_tokens", "max_tokens -1")
    refused(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=2,
                                              extra_body={"temperature": "hot"}), "temperature", "temperature hot")
    refused(lambda: client.completions.create(model=model, prompt=[[1, 2], [3, 4]], max_tokens=2), "prompt",
            "batched prompts")
    refused(lambda: client.chat.completions.create(model=model, max_tokens=2,
                                                   messages=[{"role": "root", "content": "x"}]),
            "messages[0].role", "role root")
    print("ok type errors and roles")

    # Request ids: the client's, returned and ending the response id; made ones unique.
    raw = client.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=2,
                                                      extra_headers={"x-request-id": "sdk-check-34"})
    check(raw.headers.get("x-request-id") == "sdk-check-34", f"x-request-id {raw.headers.get('x-request-id')}")
    check(raw.parse().id == "cmpl-sdk-check-34", f"id {raw.parse().id}")
    ids = {client.completions.create(model=model, prompt="Hi", max_tokens=1).id for _ in range(3)}
    check(len(ids) == 3, f"ids {ids}")
    print("ok request ids")

    # An unknown route: OpenAI's error JSON.
    root = args.base_url.rstrip("/").removesuffix("/v1")
    try:
        urllib.request.urlopen(root + "/v1/no-such-route", timeout=30)
        raise AssertionError("an unknown route answered 2xx")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        check(e.code == 404, f"unknown route status {e.code}")
        check(set(body["error"]) >= {"message", "type", "param", "code"}, f"unknown route body {body}")
    print("ok unknown route")

    # Concurrent async streams: each gets the greedy text it gets alone.
    async def many(n):
        aclient = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)

        async def one():
            out = ""
            stream = await aclient.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                                      stream=True)
            async for ch in stream:
                if ch.choices:
                    out += ch.choices[0].text
            return out

        try:
            return await asyncio.gather(*[one() for _ in range(n)])
        finally:
            await aclient.close()

    texts = asyncio.run(many(8))
    check(all(t == greedy for t in texts), f"concurrent streams {texts}, alone {greedy!r}")
    print("ok 8 concurrent async streams")

    print(f"PASS {passed} checks")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL {e}", file=sys.stderr)
        sys.exit(1)
