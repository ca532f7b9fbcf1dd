"""User questions for distilling a chat model's own answers (`pagedllm distill --chat`).

A speculative-decoding draft for a chat model has to learn what the target answers to chat
questions, so its training prompts must be chats of the kinds users send (explanations, facts,
short writing, advice) — not windows of a text corpus. No dataset is downloaded: the questions are
every (topic, question form) pair below, shuffled by a seed. None of them is one of the questions
`pagedllm bench spec` measures on (bench/chat_prompts.py; a test keeps it so), so the bench never
scores a draft on its own training text."""
from __future__ import annotations

import random

TOPICS = (
    "the moon", "volcanoes", "bread", "the ocean", "honey bees", "coffee", "the Roman Empire", "electric cars",
    "rainbows", "dinosaurs", "the human brain", "chess", "tea", "gardening", "recycling", "the internet",
    "solar panels", "the piano", "elephants", "earthquakes", "pizza", "the Olympic Games", "snow", "friendship",
    "money", "the library", "bicycles", "photography", "yoga", "the stock market", "penguins", "the desert",
    "chocolate", "trains", "the violin", "sharks", "the Great Wall of China", "cheese", "clouds", "memory",
    "running", "soap", "the printing press", "rice", "lightning", "the telephone", "whales", "mushrooms", "glass",
    "the Amazon rainforest", "wind turbines", "the Eiffel Tower", "swimming", "volunteering", "the calendar",
    "meditation", "basketball", "ants", "the sun", "batteries", "public speaking", "sleep", "vitamins", "robots",
    "the alphabet", "maps", "castles", "the immune system", "tides", "wolves", "paper", "the French Revolution",
    "jazz", "kites", "origami", "the Moon landing", "bridges", "typing", "cooking pasta", "time zones",
    "the Sahara", "owls", "plastic", "democracy", "taxes", "flowers", "the heart", "birthdays", "camping",
    "coral reefs", "the Nile", "Mars", "saving money", "learning math", "painting", "football", "the post office",
    "tigers", "a healthy diet", "the Renaissance", "spiders", "rain", "museums", "the weather",
    "the periodic table", "ancient Egypt", "dolphins", "vaccines", "hiking", "skyscrapers", "ice cream",
    "the sewing machine", "storms", "the solar system", "gravity", "magnets", "fire", "the wheel", "the camera",
    "the microwave oven", "jellyfish", "apples", "poetry", "theatre", "Jupiter", "remote work",
    "job interviews", "a first aid kit", "composting", "candles",
)
FORMS = (
    "What is {}?", "Tell me about {}.", "Explain {} to a child.", "Give me three facts about {}.",
    "Write a short poem about {}.", "Why is {} important?", "What is the history of {}?", "How does {} work?",
    "Describe {} in a few sentences.", "What are some fun facts about {}?", "What should everyone know about {}?",
    "Write a short story about {}.", "What are the pros and cons of {}?", "How can I learn more about {}?",
)


def questions(count: int, seed: int = 0) -> list[str]:
    """`count` questions (at most every pair's one), the same for the same seed; the first
    `count` of a shuffle, so a smaller count gives a prefix of a larger one."""
    every = [form.format(topic) for topic in TOPICS for form in FORMS]
    random.Random(seed).shuffle(every)
    return every[:count]


def read_questions(path: str) -> list[str]:
    """One question a line (blank lines skipped): a user's own prompts for `--chat --questions`."""
    with open(path, encoding="utf-8") as f:
        found = [line.strip() for line in f if line.strip()]
    if not found:
        raise ValueError(f"{path}: no questions (one a line)")
    return found
