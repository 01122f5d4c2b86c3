"""A plain OpenAI-SDK agent that plays guess-the-number: it knows nothing of tokenmill.

It is the kind of program proxy mode trains: point its `base_url` at tokenmill's endpoint, one URL per
episode (`.../proxy/<episode id>/v1`), and post each episode's reward when the game ends. Swap the URL for
api.openai.com (and the reward post for a no-op) and it plays against any chat model.

    python agent.py --url http://127.0.0.1:8011 --games 64 --group-size 8
"""

from __future__ import annotations

import argparse
import random
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI


def play(url: str, secret: int, high: int, turns: int, group: str, token: str) -> float:
    """One game: the model guesses, we answer higher / lower; reward 1 if it finds the secret."""
    episode = uuid.uuid4().hex
    client = OpenAI(base_url=f"{url}/proxy/{episode}/v1", api_key=token, max_retries=2, timeout=60)
    messages = [{"role": "system", "content": "guess"}, {"role": "user", "content": f"1-{high}"}]
    reward = 0.0
    for _ in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4, temperature=1.0)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        found = re.fullmatch(r"\s*(\d{1,3})\s*", text)
        if found and int(found.group(1)) == secret:
            reward = 1.0
            break
        if found and 1 <= int(found.group(1)) <= high:
            messages.append({"role": "user", "content": "higher" if int(found.group(1)) < secret else "lower"})
        else:
            messages.append({"role": "user", "content": f"1-{high}?"})
    # the one tokenmill-specific line: tell the trainer how the episode went
    httpx.post(f"{url}/v1/episodes/{episode}/reward", json={"reward": reward, "group": group},
               headers={"Authorization": f"Bearer {token}"}, timeout=30).raise_for_status()
    return reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="tokenmill's endpoint, e.g. http://127.0.0.1:8011")
    ap.add_argument("--games", type=int, default=64, help="secrets to play (each played group-size times)")
    ap.add_argument("--group-size", type=int, default=8, help="games per secret, compared with each other")
    ap.add_argument("--high", type=int, default=7)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=32, help="games played at once")
    ap.add_argument("--token", default="none", help="bearer token, if the server has one")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    jobs = []
    for g in range(args.games):
        secret = rng.randint(1, args.high)
        jobs += [(secret, f"{args.seed}-{g}")] * args.group_size
    with ThreadPoolExecutor(args.parallel) as pool:
        rewards = list(pool.map(lambda j: play(args.url, j[0], args.high, args.turns, j[1], args.token), jobs))
    print(f"played {len(rewards)} games, solved {sum(rewards) / len(rewards):.3f}")


if __name__ == "__main__":
    main()
