"""The lyrics' section tags as `% section` labels placed by syllables, and their syllables against the notes."""
from yue2_vllm.transcription.sections import (LyricSection, lyric_sections, native_label, place_sections,
                                              syllable_warning, syllables)

LYRICS = """[Verse 1]
Twinkle twinkle little star
How I wonder what you are

[Chorus]
Up above the world so high
Like a diamond in the sky
"""


def test_syllables_are_vowel_groups_of_words_and_characters_of_syllabic_scripts():
    assert syllables("Twinkle twinkle little star") == 7
    assert syllables("How I wonder what you are") == 7
    assert syllables("Make the time to love, don't hate") == 7  # silent final e's
    assert syllables("一闪一闪亮晶晶") == 7 and syllables("きらきら") == 4 and syllables("반짝반짝") == 4
    assert syllables("") == 0 and syllables("1, 2, 3!") == 0


def test_tags_read_as_upstreams_native_labels():
    assert [native_label(tag) for tag in ("Verse 2", "Pre Chorus", "prechorus", "CHORUS", "Hook", "Bridge_1",
                                          "Outro", "Rap", "Solo")] == \
        ["verse", "pre-chorus", "pre-chorus", "chorus", "chorus", "bridge", "outro", None, "instrumental"]


def test_the_lyrics_sections_in_order_with_their_syllables():
    assert lyric_sections("la la\n" + LYRICS + "[Rap]\n[outro] la la la\n") == [
        LyricSection("", None, 2), LyricSection("Verse 1", "verse", 14), LyricSection("Chorus", "chorus", 14),
        LyricSection("Rap", None, 0), LyricSection("outro", "outro", 3)]


def phrases(count, notes_per_phrase, bar_steps=16):
    """`count` phrases of quarter notes, each a bar and a half long, then a half-bar rest (two bars a phrase)."""
    positions = [phrase * 2 * bar_steps + 4 * i for phrase in range(count) for i in range(notes_per_phrase)]
    return positions, [4] * len(positions)


def test_a_section_starts_on_the_bar_of_the_phrase_its_syllables_reach():
    positions, lengths = phrases(4, 7)  # 28 notes, 7 a phrase: the lyrics' four lines of 7 syllables
    labels, warnings = place_sections(LYRICS, positions, lengths, 16)
    assert labels == {0: "verse", 4: "chorus"} and warnings == []


def test_a_section_moves_to_the_nearest_phrase_start():
    positions, lengths = phrases(4, 7)
    labels, _ = place_sections("[verse]\n" + "la " * 13 + "\n[chorus]\n" + "la " * 15, positions, lengths, 16)
    # The chorus's first syllable falls on the second phrase's last note (bar 4, 0-based 3); the next phrase starts
    # a note later, on the bar after it.
    assert labels == {0: "verse", 4: "chorus"}


def test_warnings_name_what_will_not_fit():
    positions, lengths = phrases(2, 7)
    labels, warnings = place_sections("[intro]\n[verse]\n" + "la " * 40 + "\n[Rap]\nyo yo\n", positions, lengths,
                                      16)
    assert labels == {0: "verse"}
    assert [w.code for w in warnings] == ["syllables", "section-labels", "sections"]
    assert warnings[0].figures == {"syllables": 42, "notes": 14, "per_note": 3.0}
    assert warnings[1].figures == {"tags": ["Rap"]} and warnings[2].figures == {"tags": ["intro"]}
    assert syllable_warning(lyric_sections("la " * 14), 14) is None


def test_tags_without_words_label_only_the_start():
    positions, lengths = phrases(2, 7)
    labels, warnings = place_sections("[verse]\n[chorus]\n", positions, lengths, 16)
    assert labels == {0: "verse"} and [w.code for w in warnings] == ["sections"]
