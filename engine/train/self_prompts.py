"""The built-in prompts a model answers to write its own training text (`self_text.py`).

Eight kinds, seven prompts each, so the text covers what a chat model is asked to write: code,
maths, small talk, facts, stories, instructions, other languages, reasoning. One prompt of each
kind is held out (`held_out_prompts`): the replies to those are the text phase 1 measures on.

Changing a prompt changes the text: raise PROMPT_SET_VERSION, so no cached text of the old set
is read as the new one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

PROMPT_SET_VERSION = 1


@dataclass(frozen=True)
class Prompt:
    kind: str
    text: str


_BY_KIND: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python function that checks whether a string is a palindrome, with tests.",
        "Explain the difference between a list and a tuple in Python, with examples.",
        "Write a SQL query that returns the ten customers who spent the most last year.",
        "Here is a bug: `for i in range(len(xs)): xs.remove(xs[i])` fails. Why, and how do I fix it?",
        "Implement binary search in Rust and explain its complexity.",
        "Write a small JavaScript function that debounces another function.",
        "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    ),
    "maths": (
        "Solve 3x + 7 = 25 step by step.",
        "What is the derivative of x^3 * sin(x)? Show your work.",
        "Prove that the square root of 2 is irrational.",
        "A train travels 240 km in 3 hours. How long does it take to travel 400 km at that speed?",
        "Explain what a prime number is and list the primes below 50.",
        "What is the probability of getting at least one six in four rolls of a die?",
        "Compute the sum of the integers from 1 to 1000 and explain the trick.",
    ),
    "chat": (
        "Hi! How are you today?",
        "I feel a bit stressed about my exams next week. Any advice?",
        "Can you recommend a good book for a long train journey?",
        "What should I cook tonight? I have rice, eggs and some spinach.",
        "Tell me a joke about computers.",
        "I just adopted a cat. What do I need to know?",
        "What's a good way to start learning the guitar as an adult?",
    ),
    "facts": (
        "Why is the sky blue?",
        "Who was Marie Curie and what did she discover?",
        "How does photosynthesis work?",
        "What caused the fall of the Western Roman Empire?",
        "Explain how a vaccine trains the immune system.",
        "What is the difference between weather and climate?",
        "How do airplanes stay in the air?",
    ),
    "story": (
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Write a poem about the sea at night.",
        "Tell a fairy tale about a fox who wanted to fly.",
        "Write the opening scene of a mystery novel set in a snowed-in hotel.",
        "Write a dialogue between a robot and a child meeting for the first time.",
        "Describe a bustling market in a city of the future.",
        "Write a haiku sequence about the four seasons.",
    ),
    "instructions": (
        "Summarize the plot of Romeo and Juliet in three sentences.",
        "Write a polite email to my landlord asking to fix a leaking tap.",
        "Give me a packing list for a week-long hiking trip.",
        "Rewrite this sentence to be more formal: 'gonna be late, traffic is nuts'.",
        "List five tips for giving a good presentation.",
        "Translate into plain English: 'The party of the first part shall indemnify the party of "
        "the second part.'",
        "Make a weekly study plan for learning basic Spanish.",
    ),
    "languages": (
        "Explique-moi en français comment fonctionne un moteur à combustion.",
        "Erzähl mir auf Deutsch eine kurze Geschichte über einen Bären im Wald.",
        "¿Cuáles son los beneficios de hacer ejercicio regularmente? Responde en español.",
        "请用中文介绍一下长城的历史。",
        "日本の四季について日本語で説明してください。",
        "Расскажи по-русски, как приготовить борщ.",
        "Descreva em português um dia típico numa cidade à beira-mar.",
    ),
    "reasoning": (
        "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
        "I have three boxes, one with apples, one with oranges, one with both, all mislabeled. "
        "How can I label them correctly by picking one fruit?",
        "What are the pros and cons of working from home?",
        "Should a small town build a new library or a new sports centre? Weigh both sides.",
        "A bat and a ball cost 1.10 in total. The bat costs 1.00 more than the ball. How much "
        "does the ball cost?",
        "Plan the fastest way to visit five cities if each flight costs the same.",
        "Why might a company choose to open-source its software?",
    ),
}

PROMPTS: tuple[Prompt, ...] = tuple(
    Prompt(kind, text) for kind, texts in _BY_KIND.items() for text in texts
)


def held_out_prompts(prompts: tuple[Prompt, ...] = PROMPTS) -> frozenset[int]:
    """Indices of the held-out prompts: in each kind, the one lowest by SHA-256 of its text (the
    same on every machine, and every kind is measured)."""
    held = {}
    for i, prompt in enumerate(prompts):
        rank = hashlib.sha256(prompt.text.encode()).hexdigest()
        if prompt.kind not in held or rank < held[prompt.kind][0]:
            held[prompt.kind] = (rank, i)
    return frozenset(i for _, i in held.values())
