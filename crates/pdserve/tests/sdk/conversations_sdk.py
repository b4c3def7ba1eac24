"""The OpenAI Python SDK's Conversations API against one base URL.

    python conversations_sdk.py BASE_URL     (e.g. http://127.0.0.1:8000/v1)

Creates a conversation with metadata and an item, adds five more, pages through them with
the SDK's auto-paging (limit 2, oldest first and newest first), retrieves and deletes one
item, updates the metadata, deletes the conversation and checks that it is gone. Prints
one JSON object with what it saw; the Rust test checks it.
"""

import json
import sys

import openai


def main() -> None:
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
    conv = client.conversations.create(
        metadata={"topic": "sdk"},
        items=[{"type": "message", "role": "user", "content": "first"}],
    )
    added = client.conversations.items.create(
        conv.id,
        items=[{"type": "message", "role": "user", "content": f"m{i}"} for i in range(1, 6)],
    )

    def texts(items):
        return [item.content[0].text for item in items]

    asc = texts(client.conversations.items.list(conv.id, limit=2, order="asc"))
    desc = texts(client.conversations.items.list(conv.id, limit=2))
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    after_delete = client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    remaining = texts(client.conversations.items.list(conv.id, order="asc"))
    updated = client.conversations.update(conv.id, metadata={"stage": "two"})
    retrieved = client.conversations.retrieve(conv.id)
    deleted = client.conversations.delete(conv.id)
    try:
        client.conversations.retrieve(conv.id)
        gone = "still there"
    except openai.NotFoundError as e:
        gone = e.status_code
    print(json.dumps({
        "id": conv.id,
        "object": conv.object,
        "metadata": conv.metadata,
        "added": texts(added.data),
        "asc": asc,
        "desc": desc,
        "one": one.content[0].text,
        "after_delete": after_delete.id,
        "remaining": remaining,
        "updated": updated.metadata,
        "retrieved": retrieved.metadata,
        "deleted": deleted.deleted,
        "gone": gone,
    }))


if __name__ == "__main__":
    main()
