"""Public-domain passages and prompts for benchmarks/spec_decode.py: copy-heavy tasks (repeat or correct a
passage, quote it) and plain chat questions like the README's.

Texts: Abraham Lincoln, the Gettysburg Address (1863, Bliss copy); Charles Dickens, A Tale of Two Cities
(1859), its opening sentence; the United States Declaration of Independence (1776), the start of its second
paragraph. All are in the public domain.
"""

from __future__ import annotations

GETTYSBURG = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal.\n\n"
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a "
    "portion of that field, as a final resting place for those who here gave their lives that that nation "
    "might live. It is altogether fitting and proper that we should do this.\n\n"
    "But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. "
    "The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add "
    "or detract. The world will little note, nor long remember what we say here, but it can never forget what "
    "they did here. It is for us the living, rather, to be dedicated here to the unfinished work which they "
    "who fought here have thus far so nobly advanced. It is rather for us to be here dedicated to the great "
    "task remaining before us -- that from these honored dead we take increased devotion to that cause for "
    "which they gave the last full measure of devotion -- that we here highly resolve that these dead shall "
    "not have died in vain -- that this nation, under God, shall have a new birth of freedom -- and that "
    "government of the people, by the people, for the people, shall not perish from the earth.")

TWO_CITIES = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way--in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only.")

DECLARATION = (
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed by their "
    "Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of "
    "Happiness.--That to secure these rights, Governments are instituted among Men, deriving their just "
    "powers from the consent of the governed, --That whenever any Form of Government becomes destructive of "
    "these ends, it is the Right of the People to alter or to abolish it, and to institute new Government, "
    "laying its foundation on such principles and organizing its powers in such form, as to them shall seem "
    "most likely to effect their Safety and Happiness.")

PASSAGES = (GETTYSBURG, TWO_CITIES, DECLARATION)

# (instruction, passage transform): what a user asks of a passage they paste in
COPY_TASKS = (
    ("Repeat the following passage exactly, word for word.", lambda text: text),
    ("Correct the spelling mistakes in this passage and return the whole corrected passage.",
     lambda text: text.replace("the ", "teh ", 2)),
    ("Rewrite this passage with every sentence on its own line.", lambda text: text),
)

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three tips for learning to program.",
    "What is photosynthesis?",
    "Tell me a short story about a robot who learns to paint.",
)


def copy_messages() -> list[list[dict[str, str]]]:
    """One conversation per (task, passage): the instruction, then the passage to work on."""
    return [[{"role": "user", "content": f"{instruction}\n\n{transform(passage)}"}]
            for instruction, transform in COPY_TASKS for passage in PASSAGES]


def chat_messages() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": question}] for question in CHAT_QUESTIONS]
