"""Sentences for scoring end of turn on text alone, word by word (`python -m bench.turns --text`): everyday requests
of the kind people say to a voice assistant, written for this bench (not transcripts of ../shared/audio). Many have
a clause end inside ("..., so", "... but"), where a pause is most often mistaken for the end. The `tune` half is
what thresholds may be chosen on; the `check` half says whether they generalise."""

TUNE = (
    "Can you tell me what the weather will be like tomorrow?",
    "I was thinking about going to the beach this weekend if it does not rain.",
    "My sister is coming to visit next month and I need a good restaurant.",
    "How long does it take to boil an egg?",
    "Set a timer for ten minutes.",
    "I need to buy a present for my father, who loves gardening.",
    "What time does the pharmacy close on Sundays?",
    "We missed the train because the taxi was late.",
    "Could you remind me to call the dentist tomorrow morning?",
    "The meeting was moved to Thursday, so I have some free time now.",
    "I have been trying to learn Spanish, but the grammar is hard.",
    "Is it safe to leave my bike outside overnight?",
    "Tell me a joke about cats.",
    "My laptop gets really hot when I watch videos.",
    "I would like to book a table for four people at seven.",
    "Which planet is closest to the sun?",
    "After dinner we walked along the harbour and watched the boats.",
    "I think I left my keys at the office.",
    "Do you know any good books about the history of Rome?",
    "The kids want pancakes for breakfast, but we are out of eggs.",
)
CHECK = (
    "Why is the sky blue during the day?",
    "The museum is closed on Mondays but open late on Fridays.",
    "Can you recommend a movie for a rainy afternoon?",
    "I forgot to water the plants before we left for the holiday.",
    "What is the best way to get to the airport from here?",
    "My neighbour plays loud music every night and I cannot sleep.",
    "How many cups are in a litre?",
    "She said she would call me back, but she never did.",
    "Turn off the lights in the kitchen.",
    "I am planning a trip to Japan in the spring when the cherry trees bloom.",
    "Do I need a visa to travel to Canada?",
    "The soup tastes a bit bland, so what should I add?",
    "We adopted a puppy last week and he chews everything.",
    "Where can I recycle old batteries?",
    "I want to start running, but my knees hurt after a few minutes.",
    "What does the word serendipity mean?",
    "Our flight was delayed for three hours because of the storm.",
    "Play some relaxing music.",
    "If I leave now, will I make it before the shop closes?",
    "My grandmother makes the best apple pie in the world.",
)
