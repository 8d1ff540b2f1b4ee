from jukebox import Tape

tape = Tape.load("./tapes/tr_8f92a1c4.jbx")
b_side = tape.fork(
    at_frame=3,
    override_model="claude-3-7-sonnet-latest",
    override_system_prompt="You are a strict SQL auditor. Never issue DELETE without a WHERE clause.",
)
print(b_side.replay_and_diff().to_markdown())
