"""The turn policy driven through scripted event sequences: no models, no network, no event loop."""

from __future__ import annotations

from gateway.turn import (
    CancelReply,
    CommitReply,
    ConfirmReply,
    EndTurn,
    Interrupt,
    PausePlayout,
    Prefill,
    ResumePlayout,
    ScorePause,
    StartReply,
    TurnController,
    TurnPolicy,
    continue_line,
    is_backchannel,
    words_of,
)


def replying(policy: TurnPolicy | None = None, heard: bool = True) -> TurnController:
    """A controller whose first reply is committed and playing; `heard`: its first words were played."""
    controller = TurnController(policy or TurnPolicy())
    controller.on_speech_started(0)
    controller.on_speech_stopped(1500)
    controller.on_candidate(1600, "What is the time?")
    assert controller.on_final(1700, "What is the time?") == [CommitReply(1, "What is the time?")]
    if heard:
        controller.on_words_heard(1)
    return controller


def test_a_speculative_reply_starts_at_the_candidate_and_is_committed_by_the_same_final() -> None:
    controller = TurnController()
    assert controller.on_speech_started(0) == []
    assert controller.on_speech_stopped(1000) == []
    assert controller.on_candidate(1080, "Hello there.") == [StartReply(1, "Hello there.", speculative=True)]
    assert controller.on_final(1150, "Hello there.") == [CommitReply(1, "Hello there.")]
    assert controller.current == 1 and controller.speculative is None
    assert controller.on_reply_done(1) == [EndTurn(1)]
    assert controller.current is None


def test_a_pause_inside_a_sentence_discards_the_speculative_reply_and_answers_the_whole_sentence() -> None:
    controller = TurnController()
    controller.on_speech_started(0)
    controller.on_speech_stopped(900)
    assert controller.on_candidate(980, "The child almost hurt") == [StartReply(1, "The child almost hurt", True)]
    assert controller.on_speech_resumed(1400) == [CancelReply(1)]  # never heard, never in the history
    controller.on_speech_stopped(2400)
    assert controller.on_candidate(2480, "The child almost hurt the small dog.") == [
        StartReply(2, "The child almost hurt the small dog.", True)
    ]
    assert controller.on_final(2550, "The child almost hurt the small dog.") == [
        CommitReply(2, "The child almost hurt the small dog.")
    ]


def test_a_final_that_differs_from_the_candidate_replaces_the_speculative_reply() -> None:
    controller = TurnController()
    controller.on_candidate(100, "We are sure")
    assert controller.on_final(400, "We are sure that one war is enough.") == [
        CancelReply(1),
        StartReply(2, "We are sure that one war is enough.", speculative=False),
        CommitReply(2, "We are sure that one war is enough."),
    ]


def test_a_final_with_the_candidates_words_in_other_case_or_punctuation_keeps_the_speculative_reply() -> None:
    controller = TurnController()
    assert controller.on_candidate(100, "and so, my friends") == [StartReply(1, "and so, my friends", True)]
    assert controller.on_candidate(200, "And so my friends.") == []  # another pause, the same words: it goes on
    assert controller.on_final(400, "And so my friends.") == [CommitReply(1, "And so my friends.")]


def test_without_speculative_start_the_reply_starts_on_the_final() -> None:
    controller = TurnController(TurnPolicy(speculative_start=False))
    assert controller.on_candidate(100, "Hi.") == []
    assert controller.on_final(200, "Hi.") == [StartReply(1, "Hi.", False), CommitReply(1, "Hi.")]


def test_partials_prefill_all_their_words_when_they_change_and_only_between_replies() -> None:
    controller = TurnController()
    controller.on_speech_started(0)
    assert controller.on_partial(200, "The") == [Prefill("The")]
    assert controller.on_partial(400, "The child al") == [Prefill("The child al")]
    assert controller.on_partial(600, "The  child al") == []  # the same words
    assert controller.on_partial(800, "The child almost hurt, the") == [Prefill("The child almost hurt, the")]
    controller.on_candidate(1000, "The child almost hurt the small dog.")
    assert controller.on_partial(1100, "The child almost hurt the small dog again") == []  # a reply is under way
    controller.on_final(1200, "The child almost hurt the small dog.")
    controller.on_words_heard(1)
    controller.on_speech_started(1300)
    assert controller.on_partial(1500, "Yeah okay") == []  # a backchannel over the reply: it plays on
    # Words interrupt: the reply stops, and the words are the next turn's, prefilled from the first.
    assert controller.on_partial(1700, "Yeah okay, is it hurt") == [Interrupt(1), Prefill("Yeah okay, is it hurt")]


def test_a_candidate_with_the_words_a_prefill_scored_starts_its_reply_with_that_score() -> None:
    controller = TurnController(TurnPolicy(start_on_partials=False))  # (with it, 0.68 starts the reply at once)
    controller.on_speech_started(0)
    controller.on_partial(800, "The horizon seems")
    controller.on_prefilled("The horizon seems", 0.05)
    controller.on_partial(1600, "The horizon seems extremely distant")
    controller.on_prefilled("The horizon seems extremely distant", 0.68)
    # The words scored are those before Whisper's closing punctuation.
    assert controller.on_candidate(1900, "The horizon seems extremely distant.") == [
        StartReply(1, "The horizon seems extremely distant.", True, turn_end=0.68)
    ]
    assert controller.on_speech_resumed(2000) == [CancelReply(1)]
    # The same words in another case or punctuation, as Whisper's draft often writes a partial's: the same score.
    assert controller.on_candidate(2300, "the horizon, seems extremely distant?") == [
        StartReply(2, "the horizon, seems extremely distant?", True, turn_end=0.68)
    ]
    assert controller.on_speech_resumed(2400) == [CancelReply(2)]
    # Other words than those scored: the reply's own prefill scores them.
    assert controller.on_candidate(2600, "The horizon seems extremely distant today.") == [
        StartReply(3, "The horizon seems extremely distant today.", True)
    ]
    controller.on_final(2700, "The horizon seems extremely distant today.")
    controller.on_reply_done(3)
    # A score is of one dialogue: after the turn it belonged to, it stands for nothing.
    assert controller.on_candidate(5000, "The horizon seems extremely distant.") == [
        StartReply(4, "The horizon seems extremely distant.", True)
    ]


def test_a_partial_the_llm_scores_finished_starts_the_reply_before_the_speech_stops() -> None:
    controller = TurnController()
    controller.on_speech_started(0)
    controller.on_partial(800, "The horizon seems")
    assert controller.on_prefilled("The horizon seems", 0.05) == []  # unfinished: no reply yet
    controller.on_partial(1600, "The horizon seems extremely distant")
    assert controller.on_prefilled("The horizon seems extremely distant", 0.68) == [
        StartReply(1, "The horizon seems extremely distant", True, turn_end=0.68, on_partial=True, held_tokens=6)
    ]
    assert controller.on_partial(1800, "The horizon seems extremely distant.") == []  # the same words: it goes on
    # The speech stops; the ASR's draft has the same words: that reply answers them, none other starts.
    assert controller.on_speech_stopped(1900) == []
    assert controller.on_candidate(1950, "The horizon seems extremely distant.") == [ConfirmReply(1)]
    assert controller.on_final(2000, "The horizon seems extremely distant.") == [
        CommitReply(1, "The horizon seems extremely distant.")
    ]


def test_a_reply_started_on_a_partial_is_cancelled_when_the_words_go_on() -> None:
    controller = TurnController()
    controller.on_speech_started(0)
    controller.on_partial(800, "The kids want pancakes")
    assert controller.on_prefilled("The kids want pancakes", 0.5) == [
        StartReply(1, "The kids want pancakes", True, turn_end=0.5, on_partial=True, held_tokens=6)
    ]
    # The next partial has more words: the reply was to part of the turn. Its words go to the LLM instead.
    assert controller.on_partial(1000, "The kids want pancakes for breakfast but") == [
        CancelReply(1),
        Prefill("The kids want pancakes for breakfast but"),
    ]
    assert controller.on_prefilled("The kids want pancakes for breakfast but", 0.01) == []
    # A candidate with other words than a reply started on a partial replaces it, as any speculative reply.
    controller.on_partial(1400, "The kids want pancakes for breakfast")
    assert controller.on_prefilled("The kids want pancakes for breakfast", 0.6) == [
        StartReply(2, "The kids want pancakes for breakfast", True, turn_end=0.6, on_partial=True, held_tokens=6)
    ]
    assert controller.on_candidate(1700, "The kids want pancakes for breakfast, but we are out.") == [
        CancelReply(2),
        StartReply(3, "The kids want pancakes for breakfast, but we are out.", True),
    ]
    # A reply confirmed by a candidate is that candidate's: a partial decoded in the pause does not cancel it.
    assert controller.on_partial(1800, "The kids want pancakes for breakfast but we are out of") == []
    assert controller.on_speech_resumed(1900) == [CancelReply(3)]


def test_a_partial_starts_no_reply_on_a_stale_prefill_a_doubtful_score_or_when_the_session_turns_it_off() -> None:
    controller = TurnController()
    controller.on_speech_started(0)
    controller.on_partial(800, "Book a table")
    controller.on_partial(1000, "Book a table for two")
    assert controller.on_prefilled("Book a table", 0.9) == []  # of words a newer partial has replaced
    assert controller.on_prefilled("Book a table for two", 0.44) == []  # below start_on_partials_at
    assert controller.on_candidate(1300, "Book a table for two.") == [
        StartReply(1, "Book a table for two.", True, turn_end=0.44)  # the reply starts at the silence, as without
    ]
    for policy in (
        TurnPolicy(start_on_partials=False),
        TurnPolicy(speculative_start=False),  # no speculative reply at all: the reply waits for the final
    ):
        controller = TurnController(policy)
        controller.on_partial(800, "Book a table for two")
        assert controller.on_prefilled("Book a table for two", 0.9) == []


def test_a_prefill_score_that_comes_while_a_reply_plays_is_not_kept() -> None:
    controller = replying()
    controller.on_prefilled("Wait", 0.9)
    controller.on_speech_started(3000)
    assert controller.on_candidate(3300, "Wait.") == [Interrupt(1), StartReply(2, "Wait.", True)]


def test_partials_prefill_nothing_when_the_session_turns_it_off() -> None:
    controller = TurnController(TurnPolicy(prefill_partials=False))
    assert controller.on_partial(400, "The child almost hurt") == []


def test_noise_and_silence_start_no_reply() -> None:
    controller = TurnController()
    assert controller.on_candidate(100, "") == []
    assert controller.on_candidate(100, "[coughing]") == []
    assert controller.on_final(300, "(door slams)") == []
    assert controller.current is None and controller.speculative is None


def test_a_backchannel_over_the_reply_does_not_stop_it() -> None:
    controller = replying()
    assert controller.on_speech_started(3000) == []
    assert controller.on_speech_stopped(3300) == []  # 300 ms: under the 500 ms that would pause the reply
    assert controller.on_candidate(3400, "Yeah.") == []
    assert controller.on_final(3700, "Yeah.") == []
    assert controller.tick(6000) == []
    assert controller.current == 1
    assert controller.on_reply_done(1) == [EndTurn(1)]


def test_a_long_backchannel_pauses_the_reply_and_its_words_resume_it() -> None:
    controller = replying()
    controller.on_speech_started(3000)
    assert controller.next_tick_ms == 3500
    assert controller.tick(3500) == [PausePlayout(1)]
    assert controller.paused
    assert controller.on_partial(3600, "Mm-hmm.") == [ResumePlayout(1, "backchannel")]
    assert not controller.paused and controller.current == 1
    assert controller.on_final(4000, "Mm-hmm.") == []  # not a user turn


def test_a_false_interruption_pauses_the_reply_then_resumes_where_it_paused() -> None:
    controller = replying()
    controller.on_speech_started(3000)  # a cough
    assert controller.tick(3500) == [PausePlayout(1)]
    assert controller.on_speech_stopped(3600) == []
    assert controller.on_candidate(3700, "") == []  # no words
    assert controller.next_tick_ms == 4500
    assert controller.tick(4400) == []
    assert controller.tick(4500) == [ResumePlayout(1, "false_interruption")]
    assert controller.current == 1 and not controller.paused


def test_a_wordless_final_ends_the_pause_at_once() -> None:
    controller = replying()
    controller.on_speech_started(3000)
    controller.tick(3500)
    assert controller.on_final(3900, "") == [ResumePlayout(1, "false_interruption")]


def test_words_over_the_reply_interrupt_it_and_become_the_next_turn() -> None:
    controller = replying()
    controller.on_speech_started(3000)
    assert controller.on_partial(3250, "Wait, stop") == [Interrupt(1), Prefill("Wait, stop")]  # words decide at once
    assert controller.current is None
    controller.on_speech_stopped(3600)
    assert controller.on_candidate(3700, "Wait, stop.") == [StartReply(2, "Wait, stop.", True)]
    assert controller.on_final(3800, "Wait, stop.") == [CommitReply(2, "Wait, stop.")]


def test_words_before_any_of_the_reply_was_heard_continue_the_turn() -> None:
    # Committed in a pause inside the sentence; the user goes on before a word of the reply was played.
    controller = TurnController()
    controller.on_speech_started(0)
    controller.on_speech_stopped(2900)
    controller.on_candidate(2950, "He began a confused complaint against the wizard.")
    controller.on_final(3000, "He began a confused complaint against the wizard.")
    controller.on_speech_started(3400)
    assert controller.on_partial(3700, "who had vanished") == [
        Interrupt(1, continued=True),
        Prefill("He began a confused complaint against the wizard who had vanished"),
    ]
    controller.on_speech_stopped(5000)
    whole = "He began a confused complaint against the wizard who had vanished behind the curtain."
    assert controller.on_candidate(5050, "who had vanished behind the curtain.") == [StartReply(2, whole, True)]
    assert controller.on_final(5100, "who had vanished behind the curtain.") == [CommitReply(2, whole)]
    # The next turn is a turn of its own again.
    controller.on_words_heard(2)
    assert controller.on_reply_done(2) == [EndTurn(2)]
    assert controller.on_final(9000, "Thanks.") == [StartReply(3, "Thanks.", False), CommitReply(3, "Thanks.")]


def test_speech_over_a_reply_none_of_which_was_heard_pauses_it_at_once_and_a_cough_resumes_it() -> None:
    controller = replying(heard=False)
    assert controller.on_speech_started(1900) == [PausePlayout(1)]  # not after barge_in_min_speech_ms
    controller.on_speech_stopped(2100)
    assert controller.on_final(2300, "") == [ResumePlayout(1, "false_interruption")]
    controller.on_words_heard(1)
    assert controller.on_speech_started(3000) == []  # heard: speech over it waits for words or 500 ms as before


def test_a_reply_heard_in_part_is_interrupted_and_the_words_are_a_turn_of_their_own() -> None:
    controller = replying(heard=True)
    controller.on_speech_started(3000)
    assert controller.on_partial(3250, "and the date") == [Interrupt(1, continued=False), Prefill("and the date")]


def test_continuing_an_unheard_turn_is_switchable() -> None:
    controller = replying(TurnPolicy(continue_unheard_turns=False), heard=False)
    controller.on_speech_started(3000)
    assert controller.on_partial(3250, "and the date") == [Interrupt(1), Prefill("and the date")]


def test_a_continued_turn_whose_speech_had_no_words_is_answered_as_it_was() -> None:
    # Without false-interruption handling, long wordless speech interrupts; it yields no words, so the turn it
    # continued is answered alone rather than never.
    controller = replying(TurnPolicy(resume_false_interruptions=False), heard=False)
    controller.on_speech_started(3000)
    assert controller.tick(3500) == [Interrupt(1, continued=True)]
    assert controller.on_final(4200, "") == [
        StartReply(2, "What is the time?", False),
        CommitReply(2, "What is the time?"),
    ]


def test_a_continued_line_drops_the_full_stop_only_before_lower_case() -> None:
    assert continue_line("He began against the wizard.", "who had gone.") == "He began against the wizard who had gone."
    assert continue_line("What is the time?", "And the date?") == "What is the time? And the date?"
    assert continue_line("Stop.", "Tell me a joke.") == "Stop. Tell me a joke."
    assert continue_line("Hello.", "") == "Hello."


def test_a_short_word_over_the_reply_interrupts_once_it_is_transcribed() -> None:
    controller = replying()
    controller.on_speech_started(3000)
    controller.on_speech_stopped(3250)  # "No." is short: no pause
    assert controller.on_candidate(3350, "No.") == [Interrupt(1), StartReply(2, "No.", True)]


def test_a_backchannel_then_words_interrupts() -> None:
    controller = replying()
    controller.on_speech_started(3000)
    assert controller.on_partial(3200, "Yeah") == []
    assert controller.on_partial(3600, "Yeah, but what about tomorrow") == [
        Interrupt(1),
        Prefill("Yeah, but what about tomorrow"),
    ]


def test_without_false_interruption_handling_long_speech_interrupts() -> None:
    controller = replying(TurnPolicy(resume_false_interruptions=False))
    controller.on_speech_started(3000)
    assert controller.tick(3500) == [Interrupt(1)]


def test_with_barge_in_off_speech_over_the_reply_changes_nothing() -> None:
    controller = replying(TurnPolicy(barge_in=False))
    assert controller.on_speech_started(3000) == []
    assert controller.tick(5000) == []
    assert controller.on_partial(3300, "Stop talking") == []
    assert controller.on_final(4000, "Stop talking.") == []
    assert controller.current == 1


def test_configured_backchannels_replace_the_defaults() -> None:
    controller = replying(TurnPolicy(backchannels=frozenset({"ja", "genau"})))
    controller.on_speech_started(3000)
    assert controller.on_partial(3200, "Genau.") == []
    assert controller.on_partial(3400, "Yeah.") == [Interrupt(1), Prefill("Yeah.")]  # not an acknowledgement here


def test_the_tts_going_down_mid_reply_ends_the_turn_and_listening_goes_on() -> None:
    controller = replying()
    assert controller.on_reply_failed(1) == [EndTurn(1)]
    assert controller.current is None
    assert controller.on_candidate(5000, "Are you there?") == [StartReply(2, "Are you there?", True)]
    assert controller.on_reply_failed(2) == [CancelReply(2)]  # a speculative reply that lost its voice
    assert controller.on_final(5200, "Are you there?") == [
        StartReply(3, "Are you there?", False),
        CommitReply(3, "Are you there?"),
    ]


def test_a_paused_reply_that_fails_ends_the_turn_without_resuming() -> None:
    controller = replying()
    controller.on_speech_started(3000)
    controller.tick(3500)
    assert controller.on_reply_failed(1) == [EndTurn(1)]
    assert controller.next_tick_ms is None and controller.tick(9000) == []


def test_words_and_backchannels_of_a_transcript() -> None:
    defaults = TurnPolicy().backchannels
    assert words_of("Uh-huh. [laughs] Okay!") == ["uh-huh", "okay"]
    assert is_backchannel(words_of("Mm-hmm."), defaults)
    assert is_backchannel(words_of("Oh, I see."), defaults)
    assert not is_backchannel(words_of("I see a problem."), defaults)
    assert not is_backchannel([], defaults)
    # Hums as Whisper spells them from one decode to the next (tiny.en wrote "Mm-m-m-" for a hum and "MM" for an
    # "mm-hmm"); and the acknowledgements people say over a reply that the first list missed.
    for hum in ("Mm-m-m-", "MM", "M.", "Hmmm.", "Mmhmm.", "Mhmm", "mm-hm", "Uhm.", "Ahh.", "Erm,", "Uhhuh."):
        assert is_backchannel(words_of(hum), defaults), hum
    for said in ("All right.", "Exactly. Exactly.", "Wow.", "Oh, nice.", "That's right.", "Makes sense.", "I know."):
        assert is_backchannel(words_of(said), defaults), said
    # Words that merely look like hums, and hums before words, still interrupt.
    for said in ("Ma!", "Home.", "Hum.", "Hmm, wait.", "Um, stop.", "No.", "Oh no.", "Really?", "I know, but why?"):
        assert not is_backchannel(words_of(said), defaults), said
    # A session's own list replaces the words, not the hums.
    assert is_backchannel(words_of("Mmm."), frozenset({"yes"}))
    assert not is_backchannel(words_of("Okay."), frozenset({"yes"}))


# ---- pause scores, held replies, the session's scorer --------------------------------------------------------------
def test_a_pause_gets_the_score_of_the_reply_that_answers_it_and_a_later_pause_with_its_words_too() -> None:
    controller = TurnController()
    controller.on_speech_started(0)
    assert controller.on_candidate(900, "what time is it", pause_id=1) == [
        StartReply(1, "what time is it", True, pause_id=1, score_turn_end=True)
    ]
    assert controller.on_reply_scored(1, 0.7) == [ScorePause(1, 0.7)]
    assert controller.on_candidate(1200, "What time is it?", pause_id=2) == [ScorePause(2, 0.7)]


def test_a_score_still_coming_goes_to_the_newest_pause_with_its_words() -> None:
    controller = TurnController()
    controller.on_candidate(900, "what time is it", pause_id=1)
    assert controller.on_candidate(1200, "what time is it", pause_id=2) == [], "its reply's score is on its way"
    assert controller.on_reply_scored(1, 0.3) == [ScorePause(2, 0.3)]


def test_a_pause_whose_words_a_prefill_scored_gets_that_score_at_once() -> None:
    controller = TurnController(TurnPolicy(start_on_partials=False))
    controller.on_partial(800, "what time is it")
    controller.on_prefilled("what time is it", 0.7)
    assert controller.on_candidate(900, "What time is it?", pause_id=4) == [
        StartReply(1, "What time is it?", True, turn_end=0.7, pause_id=4, score_turn_end=False),
        ScorePause(4, 0.7),
    ]


def test_a_pause_no_reply_answers_is_declined_at_once() -> None:
    controller = TurnController()
    assert controller.on_candidate(100, "", pause_id=1) == [ScorePause(1, None)]  # no words: no reply
    controller = TurnController(TurnPolicy(speculative_start=False))
    assert controller.on_candidate(100, "what time is it", pause_id=1) == [ScorePause(1, None)]
    controller = replying()
    controller.on_speech_started(3000)
    assert controller.on_candidate(3200, "mm-hmm", pause_id=5) == [ScorePause(5, None)]  # over the reply: no turn


def test_an_asr_that_does_not_number_its_pauses_gets_no_scores() -> None:
    controller = TurnController()
    assert controller.on_candidate(100, "what time is it") == [StartReply(1, "what time is it", True)]
    assert controller.on_reply_scored(1, 0.8) == []
    assert controller.on_candidate(200, "") == []


def test_a_reply_started_on_a_partial_is_held_to_its_first_words_until_a_pause_confirms_them() -> None:
    controller = TurnController(TurnPolicy(urgent_words=4))
    controller.on_partial(800, "what time is it")
    assert controller.on_prefilled("what time is it", 0.7) == [
        StartReply(1, "what time is it", True, turn_end=0.7, on_partial=True, held_tokens=10)
    ]
    # The first pause with its words confirms them (the rest may be written) and takes the prefill's score.
    assert controller.on_candidate(1000, "What time is it?", pause_id=3) == [ConfirmReply(1), ScorePause(3, 0.7)]
    assert controller.on_candidate(1300, "What time is it?", pause_id=4) == [ScorePause(4, 0.7)], "confirmed once"


def test_a_reply_started_on_a_partial_is_not_held_when_the_whole_reply_is_written_first() -> None:
    controller = TurnController(TurnPolicy(buffer_whole_reply=True))
    controller.on_partial(800, "what time is it")
    assert controller.on_prefilled("what time is it", 0.7) == [
        StartReply(1, "what time is it", True, turn_end=0.7, on_partial=True)
    ]


def test_a_session_whose_llm_does_not_score_stops_asking_for_scores_and_learns_again_when_one_comes() -> None:
    controller, other = TurnController(), TurnController()
    assert controller.asks_for_scores
    controller.on_candidate(900, "what time is it", pause_id=1)
    # The reply's first words came without a score: the pause stops waiting, and so do this session's next ones.
    assert controller.on_reply_unscored(1, scorer_missing=True) == [ScorePause(1, None)]
    assert not controller.asks_for_scores
    assert controller.on_candidate(1200, "what time is it", pause_id=2) == [ScorePause(2, None)]
    assert other.asks_for_scores, "another session's LLM is another question"
    # A reply that fails before its score declines its pause, but says nothing of what the LLM can do.
    other.on_candidate(900, "hello", pause_id=1)
    assert other.on_reply_unscored(1, scorer_missing=False) == [ScorePause(1, None)]
    assert other.asks_for_scores
    assert controller.on_reply_scored(1, 0.6) == [ScorePause(1, 0.6)], (
        "pause 2 was declined: the score is its own pause's"
    )
    assert controller.asks_for_scores


def test_with_a_fixed_hangover_nothing_asks_for_a_score() -> None:
    controller = TurnController(TurnPolicy(scores_pauses=False))
    assert not controller.asks_for_scores
    assert controller.on_candidate(100, "what time is it", pause_id=1) == [
        StartReply(1, "what time is it", True, pause_id=1)
    ]


def test_no_score_goes_to_a_cancelled_reply_s_pause_or_to_a_pause_of_a_replaced_asr_stream() -> None:
    controller = TurnController()
    controller.on_candidate(900, "what time", pause_id=1)
    assert controller.on_speech_resumed(1000) == [CancelReply(1)]
    assert controller.on_reply_scored(1, 0.9) == []
    controller.on_candidate(1500, "what time is it", pause_id=2)
    controller.on_final(1600, "what time is it")
    assert controller.on_asr_restarted() == []
    assert controller.on_reply_scored(2, 0.9) == [], "pause 2 was the old stream's"
