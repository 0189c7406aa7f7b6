"""Training prompts for ``swiftspec train-draft``: chat requests composed from our own topic and task lists.

They are written for this project (no public benchmark's questions), and the built-in ``fresh`` bench set
shares none of their topics, so a head trained on them is measured on questions it never saw.
"""

from __future__ import annotations

import random

TOPICS = [
    "black holes", "the immune system", "coral reefs", "volcanoes", "the printing press", "compound interest",
    "the French Revolution", "plate tectonics", "machine learning", "the human heart", "bees and pollination",
    "the Roman Empire", "electric cars", "the stock market", "recycling plastic", "the moon landing",
    "sleep and memory", "the Great Wall of China", "renewable energy", "inflation", "the periodic table",
    "DNA", "earthquakes", "the Renaissance", "solar panels", "antibiotics", "the internet", "glaciers",
    "the Amazon rainforest", "chess openings", "jazz music", "the Olympic Games", "coffee", "tea ceremonies",
    "bread baking", "composting", "bird migration", "the Silk Road", "ancient Egypt", "the Cold War",
    "nuclear power", "wind turbines", "tides", "rainbows", "thunderstorms", "deserts", "octopuses", "whales",
    "the Eiffel Tower", "public libraries", "credit scores", "budgeting", "time zones", "GPS", "smartphones",
    "batteries", "3D printing", "robots", "cybersecurity", "passwords", "open-source software", "databases",
    "spreadsheets", "the metric system", "prime numbers", "probability", "geometry", "fractions",
    "the Pythagorean theorem", "statistics", "gravity", "magnets", "sound waves", "light and colour",
    "the speed of light", "telescopes", "Mars", "Saturn's rings", "comets", "the Milky Way", "dinosaurs",
    "fossils", "evolution", "vitamins", "exercise", "meditation", "learning a language", "public speaking",
    "job interviews", "remote work", "team meetings", "negotiation", "saving for retirement", "gardening",
    "houseplants", "cats", "training a dog", "aquariums", "camping", "mountain climbing", "cycling",
    "marathon training", "yoga", "healthy breakfasts", "vegetarian cooking", "pasta", "spices", "chocolate",
    "cheese making", "wine regions", "city planning", "bridges", "skyscrapers", "trains", "sailing",
    "airports", "electric guitars", "the piano", "film photography", "painting with watercolours",
    "poetry", "short stories", "mythology", "fairy tales", "board games", "video game design", "origami",
    "knitting", "woodworking", "home repairs", "moving house", "wedding planning", "birthday parties",
    "volunteering", "climate change", "ocean pollution", "rain forests", "endangered species", "honey",
    "the water supply of cities", "electricity grids", "semiconductors", "cloud computing", "email etiquette",
    "grocery shopping on a budget", "meal prepping", "learning to swim", "packing for a trip", "buying a used car",
    "starting a podcast", "writing a CV", "the first day at a new job", "making friends as an adult",
    "saving energy at home", "growing tomatoes", "keeping chickens", "hiking boots", "sunscreen", "hay fever",
    "the common cold", "stretching", "good posture", "smoothies", "soup", "pizza", "cooking rice", "cookies",
    "barbecues", "birdwatching", "stargazing", "fishing", "taking photos with a phone", "learning the guitar",
    "drawing", "journaling", "reading more books", "online privacy", "spam emails", "backing up files",
    "choosing a laptop", "keyboard shortcuts", "learning to code", "Python programming", "web browsers",
    "social media", "video calls", "public transport", "road trips", "train travel in Europe", "visiting Japan",
    "learning Spanish", "tipping in restaurants", "hosting a dinner party", "gift ideas", "decorating a small room",
    "painting a wall", "fixing a dripping tap", "home insulation", "heat pumps", "electric bikes",
    "car maintenance", "moving to a new city", "sharing a house", "goldfish", "parrots", "horses", "walking",
    "tennis", "football", "basketball", "charity", "time management", "habits", "motivation", "stress",
    "naps", "screen time", "friendship", "family traditions", "New Year's resolutions", "weather forecasts",
    "snow", "autumn leaves", "spring flowers", "sea turtles", "elephants", "penguins", "ants", "spiders",
    "mushrooms", "trees", "rivers", "mountains", "islands", "the Sahara", "the Arctic", "kites",
    "paper aeroplanes", "magic tricks", "jigsaw puzzles", "crosswords", "sudoku", "museums", "theatre", "opera",
    "cartoons", "comic books", "science fiction", "detective stories", "postcards", "handwriting",
    "calculators", "clocks", "calendars", "maps", "compasses", "lighthouses", "submarines",
    "hot-air balloons", "helicopters", "rockets", "satellites", "the International Space Station",
]

TASKS = [
    "Explain {t} in simple terms.",
    "What is the most surprising fact about {t}?",
    "Give me three interesting facts about {t}.",
    "How would you explain {t} to a twelve-year-old?",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short paragraph introducing {t} to a beginner.",
    "What are common misconceptions about {t}?",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Summarise the history of {t} in a few sentences.",
    "Why does {t} matter in everyday life?",
    "List five questions a student might ask about {t}, with short answers.",
    "Give me a step-by-step guide to getting started with {t}.",
    "Write a tweet-length fun fact about {t}.",
    "What should a beginner read or watch to learn about {t}?",
    "Describe {t} using an analogy.",
    "Write a short dialogue between two friends discussing {t}.",
    "What are the key terms someone should know about {t}? Define each briefly.",
    "How has {t} changed over the last hundred years?",
    "Write a short story opening that involves {t}.",
    "What careers are connected to {t}?",
    "Give me a quiz of three multiple-choice questions about {t}.",
    "Compare {t} with {u}.",
    "What do {t} and {u} have in common?",
    "Write a short blog post title and introduction about {t}.",
    "I am giving a five-minute talk on {t}. Suggest an outline.",
    "Explain one idea from {t} that most people find confusing.",
    "What is a good way to remember the basics of {t}?",
    "Write a product description for a book about {t}.",
    "Tell me a joke about {t}.",
    "I want to get better at {t}. Where should I start?",
    "Can you give me some practical tips about {t}?",
    "What mistakes do beginners usually make with {t}?",
    "My friend says {t} is overrated. What would you tell them?",
    "How does {t} actually work?",
    "Why do people care so much about {t}?",
    "What is one thing about {t} that everyone should know?",
    "Write a short email to a colleague explaining {t}.",
    "I only have a minute. Explain {t} as briefly as you can.",
    "What questions should I ask an expert on {t}?",
    "Give me a checklist for {t}.",
    "Is {t} worth the time and money? Give me both sides.",
    "Plan a weekend around {t}.",
    "What would the world look like without {t}?",
    "Write a short motivational message about {t}.",
    "Help me write a paragraph for a school report on {t}.",
    "What is the difference between {t} and {u}?",
    "Describe a typical day for someone whose work involves {t}.",
    "Are there any health or safety concerns with {t}?",
    "Can you recommend a fun family activity related to {t}?",
]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct prompts (topic x task), in a seeded order."""
    rng = random.Random(seed)
    combos = [(task, t, u) for task in TASKS for t in TOPICS
              for u in [TOPICS[(TOPICS.index(t) * 7 + 3) % len(TOPICS)]]]
    rng.shuffle(combos)
    return [task.format(t=t, u=u) for task, t, u in combos[:n]]
