"""The fixed English text the tiny preset's tokenizer is trained on. Changing it changes every tiny model: don't."""

from __future__ import annotations

TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model learns the shape of the words it is shown.
Once upon a time there was a little village by the sea. Every morning the fishermen went out in their boats,
and every evening they came back with fish, stories and salt in their hair. The children ran along the shore
and counted the boats: one, two, three, four, five, six, seven, eight, nine, ten.
In the spring the farmers planted wheat and barley. In the summer the fields turned green, then gold.
In the autumn the harvest was brought in, and in the winter the people sat by the fire and told old tales.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: What is two plus two? Answer: Two plus two is four.
Question: What color is the sky on a clear day? Answer: The sky is blue.
Question: How many days are there in a week? Answer: There are seven days in a week.
User: Hello, how are you today? Assistant: I am well, thank you. How can I help you?
User: Please write a short poem about the moon. Assistant: The moon is bright, a lantern in the night.
User: Translate "good morning" into French. Assistant: Bonjour.
The scientist wrote her results in a notebook: the temperature was 21 degrees, the pressure was 1013 hectopascals,
and the water boiled at 100 degrees at sea level. She repeated the experiment three times to be sure.
Training a language model means showing it many examples and adjusting its weights so that the next word
becomes more likely. A low rank adapter changes only a few small matrices, while the large base model stays frozen.
Many people can train their own adapters on one shared model at the same time, each with their own data.
The library opened at nine o'clock. Readers came in quietly, found their favourite chairs and opened their books.
Some read history, some read poetry, and some read about the stars, the planets and the distant galaxies.
Mathematics is the language of patterns: numbers, shapes, changes and chances. Every proof is a small story.
The train left the station at 7:45 and arrived in the city at 10:15, only a few minutes late.
It is important to write clear code, to test it carefully, and to measure before making anything faster.
Simple things should be simple, and complex things should be possible.
"""
