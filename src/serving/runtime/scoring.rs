//! Prompt log-probabilities (`echo` with `logprobs`): the prompt scored before it is
//! scheduled, on the model's own scoring pass.

use std::sync::atomic::Ordering;

use tokio::sync::mpsc::UnboundedSender;

use super::{FinishReason, GenEvent, Loop};

impl Loop {
    /// Sends the prompt's log-probabilities (the `top` most likely tokens at each position);
    /// false when the request ends here (scoring failed, or `max_tokens` 0: scoring only).
    pub(super) fn score_prompt(
        &mut self,
        prompt: &[u32],
        top: usize,
        max_tokens: usize,
        tx: &UnboundedSender<GenEvent>,
    ) -> bool {
        match self.model.score_prompt(prompt, top) {
            Some(Ok(scored)) => {
                let _ = tx.send(GenEvent::PromptLogprobs(scored));
            }
            Some(Err(e)) => {
                self.admitted.fetch_sub(1, Ordering::SeqCst);
                let _ = tx.send(GenEvent::Error(format!("scoring the prompt failed: {e}")));
                return false;
            }
            None => {
                self.admitted.fetch_sub(1, Ordering::SeqCst);
                let _ = tx.send(GenEvent::Error(
                    "this device does not score prompts (prompt log-probabilities)".into(),
                ));
                return false;
            }
        }
        if max_tokens == 0 {
            // Scoring only: nothing to generate (vLLM's `echo` with `max_tokens: 0`).
            self.admitted.fetch_sub(1, Ordering::SeqCst);
            let _ = tx.send(GenEvent::Done {
                reason: FinishReason::Length,
                text: String::new(),
                prompt_tokens: prompt.len(),
                completion_tokens: 0,
                cached_tokens: 0,
            });
            return false;
        }
        true
    }
}
