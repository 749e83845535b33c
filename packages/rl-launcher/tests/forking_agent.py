"""A test agent whose even-numbered episodes rewrite their history, so their sessions fork
into two leaves (two samples) while odd-numbered ones stay one: every group of two
episodes trains on three samples. The reward is the episode's parity, so a group's
rewards differ."""

import openai


async def solve(base_url: str, session_id: str, sample) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
    headers = {"X-Session-Id": session_id}
    first = [{"role": "user", "content": sample.prompt}]
    reply = await client.chat.completions.create(
        model="policy", messages=first, max_tokens=4, extra_headers=headers
    )
    said = reply.choices[0].message.model_dump(exclude_none=True)
    follow_ups = ["again", "differently"] if sample.index % 2 == 0 else ["again"]
    for text in follow_ups:  # the second one continues the same first turn: a fork
        await client.chat.completions.create(
            model="policy",
            messages=[*first, said, {"role": "user", "content": text}],
            max_tokens=4,
            extra_headers=headers,
        )
    return float(sample.index % 2)
