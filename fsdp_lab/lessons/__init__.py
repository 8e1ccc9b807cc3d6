"""What the notebooks call: experiments on real ranks, the widgets that show them, and the quizzes."""
