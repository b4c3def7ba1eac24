"""The OpenAI Python SDK's Conversations API across two gateway replicas that share one
history store, with the Responses API's `conversation` parameter.

    python conversations_replicas_sdk.py BASE_URL_A BASE_URL_B

Creates a conversation on replica A, answers a turn of it on B and the next on A (each
turn's input and output appended to the conversation), lists the items on B (the SDK's
auto-paging, oldest first) and retrieves B's response on A. Prints one JSON object with
what it saw; the Rust test checks it.
"""

import json
import sys

import openai


def main() -> None:
    a, b = (
        openai.OpenAI(base_url=url, api_key="unused", max_retries=0) for url in sys.argv[1:3]
    )
    conv = a.conversations.create(
        metadata={"topic": "replicas"},
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
    )
    settings = dict(max_output_tokens=8, temperature=0)
    first = b.responses.create(input="What is my name?", conversation=conv.id, **settings)
    second = a.responses.create(input="Say it again.", conversation=conv.id, **settings)
    items = list(b.conversations.items.list(conv.id, order="asc", limit=2))
    retrieved = a.responses.retrieve(first.id)
    print(
        json.dumps(
            {
                "conversation": conv.id,
                "first_conversation": first.conversation.id if first.conversation else None,
                "first_text": first.output_text,
                "second_text": second.output_text,
                "roles": [item.role for item in items],
                "texts": [item.content[0].text for item in items],
                "retrieved": retrieved.id,
                "retrieved_text": retrieved.output_text,
                "first_id": first.id,
                "metadata": b.conversations.retrieve(conv.id).metadata,
            }
        )
    )


if __name__ == "__main__":
    main()
