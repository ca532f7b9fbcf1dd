"""Chat prompts for benchmarks of a chat model: varied user questions (explanations, advice, short
writing, how-to, facts), each rendered with the model's own chat template as `LLM.chat` would
send it. Fixed and in a fixed order, so that every run and every engine serves the same prompts."""
from __future__ import annotations

from typing import Any

QUESTIONS = (
    "What is the capital of France, and what is it known for?",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for sleeping better.",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Why is the sky blue?",
    "Can you suggest a name for a friendly dog?",
    "How does a computer store numbers?",
    "What should I pack for a weekend hiking trip?",
    "Summarize the story of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "How can I improve my writing skills?",
    "Tell me a fun fact about octopuses.",
    "What is machine learning, in simple terms?",
    "How do vaccines work?",
    "Write a polite email asking my manager for a day off.",
    "What are some healthy breakfast ideas?",
    "How do plants know which way is up?",
    "Explain what a budget is and why it helps.",
    "What causes the seasons on Earth?",
    "Give me a simple recipe for tomato soup.",
    "How do I start learning to play the guitar?",
    "What is the water cycle?",
    "Why do we need to drink water every day?",
    "Describe a good way to study for an exam.",
    "What is the tallest mountain in the world?",
    "How do airplanes stay in the air?",
    "What are the main parts of a cell?",
    "Suggest three books for someone who likes adventure stories.",
    "How can I be more productive when working from home?",
    "What is the difference between a virus and a bacterium?",
)


def chat_prompts(tokenizer: Any, count: int, first: int = 0) -> list[list[int]]:
    """Token ids of questions first .. first + count - 1 (wrapping around the list), each the
    single user message of a conversation, rendered with the model's template and a generation
    prompt (the template places BOS itself, so no special tokens are added)."""
    from pagedllm.entrypoints.chat_template import render_chat

    prompts = []
    for index in range(first, first + count):
        text = render_chat(tokenizer, [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}])
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts
