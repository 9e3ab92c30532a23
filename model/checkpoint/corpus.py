"""The text the tiny tokenizer is trained on.

It is embedded (not downloaded) so `make-tiny` works offline and gives the same vocabulary on every machine. It mixes
plain English, chat-like turns and a little Python/JSON/shell so the merges cover the kinds of text tests send.
The sentences are original; nothing here is meant to be meaningful beyond giving BPE something to count.
"""

from __future__ import annotations

CORPUS = r"""
The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox across the field.
A small model is a good model for tests: it loads in a second, runs on a laptop, and still has every part
that the large model has. When the tests pass on the small model, we try the same code on the large one.
The weather today is mild, with a light wind from the west and a few clouds over the hills in the afternoon.
She opened the window, looked at the garden, and decided that the roses needed water before lunch.
Reading a long book slowly is a pleasure; each chapter gives you time to think about what happened before.
The train to the city leaves at seven in the morning and arrives just after nine, if nothing goes wrong.
Please write a short summary of the meeting, list the open questions, and send it to the whole team.
The server answers every request with a status code, a few headers, and a body that holds the result.
If the cache already holds the first part of the prompt, the server only needs to process the new tokens.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024 and 3.14159 appear in many documents.
Dates like 2024-05-17 and times like 12:30 or 23:59:59 are common in logs, tickets and calendars.
What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two is four.
Can you help me plan a trip? Of course! Where would you like to go, and how many days do you have?
I would like to learn how to cook rice. Rinse the rice, add water, bring it to a boil, then cover and simmer.
Thank you for your help. You are welcome; let me know if there is anything else I can do for you.
The user asked for the weather in Berlin, so the assistant called the weather tool with the city name.
The tool returned a temperature of 18 degrees and light rain, and the assistant reported that to the user.
Think step by step. First, find what is known. Second, find what is asked. Third, connect the two.
Let us check the answer again: if every step follows from the one before it, the result should be right.
Every morning the baker starts the ovens at four, shapes the dough, and has fresh bread ready by six.
The river runs through the old town, under seven stone bridges, and out into the green valley below.
Good software is tested, documented and easy to change; bad software is none of these things.
An error message should say what went wrong, where it went wrong, and what the reader can do about it.
The library has books on history, science, music, cooking, gardening, travel and many other subjects.
He learned to play the piano as a child, stopped for twenty years, and started again when he retired.
Water boils at one hundred degrees at sea level, but at a lower temperature high in the mountains.
The committee will review the proposal next week and announce its decision at the end of the month.
Children were playing in the park while their parents talked on the benches under the tall trees.
Light travels very fast, yet the light from distant stars can take thousands of years to reach us.
Les enfants jouent dans le jardin. Der Hund schläft unter dem Tisch. El gato come pescado. Café, naïve, résumé.
Unicode text such as 中文字符, 日本語のテキスト, 한국어 문장, Ελληνικά and русский язык should survive a round trip.
Emoji are bytes too: 🙂 👍 🚀 ✨ — and so are symbols like © ® ™ € £ ¥ ° ± × ÷ ≤ ≥ ≠ ∞ → ←.

def add(a: int, b: int) -> int:
    '''Return the sum of two integers.'''
    return a + b


def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count


for index, item in enumerate(["alpha", "beta", "gamma", "delta"]):
    print(f"{index}: {item}")

if __name__ == "__main__":
    import json
    import sys

    data = json.loads(sys.stdin.read())
    print(json.dumps({"ok": True, "items": len(data)}, indent=2))

try:
    result = compute(value)
except ValueError as error:
    raise RuntimeError(f"could not compute: {error}") from error
finally:
    cleanup()

{"name": "get_weather", "description": "Get the current weather for a city", "parameters": {"type": "object",
 "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
 "required": ["city"]}}
{"id": 7, "title": "Fix the login page", "done": false, "tags": ["bug", "frontend"], "score": 0.75, "owner": null}

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message;
}

SELECT name, count(*) AS total FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY total DESC LIMIT 10;

$ git status
$ git commit -m "Add tests for the tokenizer"
$ python -m pytest -q tests/
$ curl -s http://localhost:8000/v1/models | python -m json.tool

#include <stdio.h>
int main(void) {
    for (int i = 0; i < 10; i++) {
        printf("%d\n", i * i);
    }
    return 0;
}

fn main() {
    let words = vec!["one", "two", "three"];
    for word in words.iter() {
        println!("{}", word.to_uppercase());
    }
}

# Notes
- Keep functions small and give them clear names.
- Write the test first when fixing a bug, so the bug cannot come back.
- Prefer plain data structures over clever ones.
- Measure before optimising; the slow part is rarely where you expect it.

The model reads the prompt, builds its cache, and then produces one token at a time until it reaches a stop token.
Each token is chosen from a probability distribution over the vocabulary; greedy decoding always takes the most
likely token, while sampling draws from the distribution using a temperature and a top-p threshold.
Speculative decoding lets a small draft model propose several tokens that the large model checks in one pass.
Attention lets every position look at earlier positions; linear attention keeps a fixed-size state instead.
Experts in a mixture model are small feed-forward networks; a router sends each token to a few of them.
Tensor parallelism splits each matrix across devices, and the devices exchange partial results after each layer.
"""
