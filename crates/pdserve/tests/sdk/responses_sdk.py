"""OpenAI's Responses API through the official Python SDK, against one pdserve entry point.

Usage: python responses_sdk.py BASE_URL   (BASE_URL like http://127.0.0.1:8000/v1)

Runs, greedy (temperature 0) and short (max_output_tokens 24): a plain
`client.responses.create`, a streamed one (its deltas must add up to the final event's
text), a three-turn chain over `previous_response_id`, retrieve and delete of a stored
response, and the errors the SDK must raise (an unknown previous response is
`NotFoundError`, function tools are `BadRequestError`). Prints one JSON object
`{"plain": {...}, "stream": {...}, "chain": [{...}, {...}, {...}]}` for the caller to
compare across stacks; exits non-zero, saying what failed, on any mismatch or error.
Standard library and `openai` only.
"""

import json
import sys
import traceback

import openai

MAX_OUTPUT_TOKENS = 24
INSTRUCTIONS = "You are a terse assistant."
PLAIN_PROMPT = "What is the capital of France?"
STREAM_PROMPT = "Name three colors."
CHAIN_TURNS = [
    "My name is Ada. What is two plus two?",
    "What is my name?",
    "Say it again, in capitals.",
]


class Failed(Exception):
    """A check of this script that did not hold."""


def check(condition, message):
    if not condition:
        raise Failed(message)


def cached_tokens(usage):
    details = getattr(usage, "input_tokens_details", None)
    check(details is not None, f"usage has no input_tokens_details: {usage!r}")
    # Older SDKs (before input_tokens_details was typed) keep it as a plain dict.
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
    else:
        cached = getattr(details, "cached_tokens", None)
    check(isinstance(cached, int), f"input_tokens_details has no cached_tokens: {details!r}")
    return cached


def usage_of(response):
    usage = response.usage
    check(usage is not None, f"response {response.id} has no usage")
    check(
        isinstance(usage.input_tokens, int) and usage.input_tokens > 0,
        f"response {response.id}: input_tokens {usage.input_tokens!r}",
    )
    check(
        isinstance(usage.output_tokens, int) and 0 < usage.output_tokens <= MAX_OUTPUT_TOKENS,
        f"response {response.id}: output_tokens {usage.output_tokens!r} "
        f"(max_output_tokens {MAX_OUTPUT_TOKENS})",
    )
    return usage


def finished(response):
    check(
        response.status in ("completed", "incomplete"),
        f"response {response.id}: status {response.status!r}",
    )
    check(response.id and response.id.startswith("resp_"), f"response id {response.id!r}")
    check(response.output_text, f"response {response.id}: empty output_text")


def plain(client, model):
    response = client.responses.create(
        model=model,
        input=PLAIN_PROMPT,
        temperature=0,
        max_output_tokens=MAX_OUTPUT_TOKENS,
    )
    finished(response)
    usage = usage_of(response)
    return {
        "id": response.id,
        "status": response.status,
        "text": response.output_text,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
    }


def stream(client, model):
    events = client.responses.create(
        model=model,
        input=STREAM_PROMPT,
        temperature=0,
        max_output_tokens=MAX_OUTPUT_TOKENS,
        stream=True,
    )
    types = []
    deltas = []
    final = None
    sequence = []
    for event in events:
        types.append(event.type)
        sequence.append(getattr(event, "sequence_number", None))
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            check(final is None, f"two final events: {types}")
            final = event.response
        elif event.type in ("response.failed", "error"):
            raise Failed(f"stream ended in {event.type}: {event!r}")
    text = "".join(deltas)
    check(final is not None, f"no response.completed or response.incomplete event: {types}")
    check(types[0] == "response.created", f"first event is {types[0]!r}: {types}")
    check(types[-1] == final_type(final), f"last event is {types[-1]!r}: {types}")
    check(
        sequence == list(range(len(types))),
        f"sequence numbers are not 0, 1, 2, ...: {sequence}",
    )
    check(deltas, f"no response.output_text.delta events: {types}")
    check(
        final.output_text == text,
        f"final event's output_text {final.output_text!r} != concatenated deltas {text!r}",
    )
    finished(final)
    usage = usage_of(final)
    return {
        "id": final.id,
        "status": final.status,
        "text": text,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "events": types,
    }


def final_type(response):
    return "response.completed" if response.status == "completed" else "response.incomplete"


def chain(client, model):
    turns = []
    previous = None
    for i, question in enumerate(CHAIN_TURNS):
        args = dict(
            model=model,
            instructions=INSTRUCTIONS,
            temperature=0,
            max_output_tokens=MAX_OUTPUT_TOKENS,
        )
        if previous is None:
            args["input"] = [{"role": "user", "content": question}]
        else:
            args["input"] = question
            args["previous_response_id"] = previous.id
        response = client.responses.create(**args)
        finished(response)
        check(
            response.previous_response_id == (previous.id if previous else None),
            f"turn {i + 1}: previous_response_id {response.previous_response_id!r}",
        )
        usage = usage_of(response)
        if previous is not None:
            check(
                usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens,
                f"turn {i + 1}: input_tokens {usage.input_tokens} do not hold the earlier "
                f"turns ({previous.usage.input_tokens} in + {previous.usage.output_tokens} out)",
            )
        turns.append(
            {
                "id": response.id,
                "status": response.status,
                "text": response.output_text,
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "cached_tokens": cached_tokens(usage),
            }
        )
        previous = response
    return turns


def retrieve_and_delete(client, turn):
    stored = client.responses.retrieve(turn["id"])
    check(stored.id == turn["id"], f"retrieve {turn['id']}: got id {stored.id!r}")
    check(
        stored.output_text == turn["text"],
        f"retrieve {turn['id']}: output_text {stored.output_text!r} != {turn['text']!r}",
    )
    client.responses.delete(turn["id"])
    try:
        client.responses.retrieve(turn["id"])
    except openai.NotFoundError:
        pass
    else:
        raise Failed(f"retrieve {turn['id']} after delete did not raise NotFoundError")


def errors(client, model):
    expected = [
        (
            "previous_response_id of no stored response",
            openai.NotFoundError,
            dict(previous_response_id="resp_does_not_exist"),
        ),
        (
            "a function tool",
            openai.BadRequestError,
            dict(
                tools=[
                    {
                        "type": "function",
                        "name": "f",
                        "parameters": {"type": "object", "properties": {}},
                    }
                ]
            ),
        ),
    ]
    for what, error, extra in expected:
        try:
            client.responses.create(
                model=model,
                input="Hi.",
                temperature=0,
                max_output_tokens=MAX_OUTPUT_TOKENS,
                **extra,
            )
        except error:
            pass
        except openai.APIStatusError as e:
            raise Failed(
                f"{what}: {type(e).__name__} ({e.status_code}: {e.message}), "
                f"want {error.__name__}"
            )
        else:
            raise Failed(f"{what}: no error, want {error.__name__}")


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} BASE_URL (like http://127.0.0.1:8000/v1)")
    client = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=60)
    step = "models.list"
    try:
        models = client.models.list().data
        check(models, "models.list returned no models")
        model = models[0].id
        step = "plain"
        result = {"plain": plain(client, model)}
        step = "stream"
        result["stream"] = stream(client, model)
        step = "chain"
        result["chain"] = chain(client, model)
        step = "retrieve and delete"
        retrieve_and_delete(client, result["chain"][-1])
        step = "errors"
        errors(client, model)
    except Failed as e:
        sys.exit(f"responses_sdk.py against {sys.argv[1]}, {step}: {e}")
    except Exception as e:  # noqa: BLE001 - any SDK or transport error fails the run
        traceback.print_exc(file=sys.stderr)
        sys.exit(f"responses_sdk.py against {sys.argv[1]}, {step}: {type(e).__name__}: {e}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
