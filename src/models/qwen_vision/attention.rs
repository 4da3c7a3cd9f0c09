//! Per-image attention in as few launches as the buffer limit allows.
//!
//! Each frame of each image (a segment of rows) attends only to itself. Neighbouring segments of
//! one length (images of one size, the usual batch) go through one batched matmul, softmax and
//! matmul together, as many as keep the scores `[segments, heads, len, len]` (f32) within the
//! limit; a segment whose scores alone do not fit goes in blocks of queries that do. Each
//! query's softmax is over its own row, so every split gives the same numbers.

use burn::tensor::Tensor;

use crate::ops::attention::{self, AttentionKernel};

/// A share of the attention one launch sequence computes: `segments` neighbouring segments of
/// `len` rows from row `at`, and of each the queries `first_query .. first_query + queries`
/// (every query where `segments > 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub at: usize,
    pub segments: usize,
    pub len: usize,
    pub first_query: usize,
    pub queries: usize,
}

/// The pieces that cover `segments` (row counts, in order) with `heads` heads, each piece's
/// scores within `limit` bytes (a piece of one query of one segment when even that does not
/// fit), in row order.
pub(crate) fn pieces(segments: &[usize], heads: usize, limit: u64) -> Vec<Piece> {
    // How many of something with `scores` f32 scores per head fit the limit.
    let fitting = |scores: usize| {
        usize::try_from(limit / (4 * heads * scores).max(1) as u64).unwrap_or(usize::MAX)
    };
    let mut pieces = Vec::new();
    let mut at = 0;
    let mut rest = segments;
    while let Some(&len) = rest.first() {
        let run = rest.iter().take_while(|&&l| l == len).count();
        let together = fitting(len * len).min(run);
        if together >= 1 {
            for first in (0..run).step_by(together) {
                let segments = together.min(run - first);
                pieces.push(Piece {
                    at: at + first * len,
                    segments,
                    len,
                    first_query: 0,
                    queries: len,
                });
            }
        } else {
            let block = fitting(len).clamp(1, len);
            for run_segment in 0..run {
                for first_query in (0..len).step_by(block) {
                    pieces.push(Piece {
                        at: at + run_segment * len,
                        segments: 1,
                        len,
                        first_query,
                        queries: block.min(len - first_query),
                    });
                }
            }
        }
        at += run * len;
        rest = &rest[run..];
    }
    pieces
}

/// The attention output of `piece`'s queries, `[segments · queries, heads · head_dim]`,
/// computed by `kernel` from `q`, `k`, `v` (`[rows, heads, head_dim]`, rotary applied, `q`
/// already scaled by `1/√head_dim`: [`super::rotary::Rotary::q`]), the softmax taken in f32
/// (as PyTorch's autocast runs it).
pub(crate) fn attend(
    q: &Tensor<3>,
    k: &Tensor<3>,
    v: &Tensor<3>,
    piece: Piece,
    kernel: AttentionKernel,
) -> Tensor<2> {
    let [_, heads, head_dim] = q.dims();
    let Piece {
        at,
        segments,
        len,
        first_query,
        queries,
    } = piece;
    // [segments, rows of each, heads, head_dim]; the queries are contiguous rows, as a piece
    // of several segments takes all of each.
    let split = |t: &Tensor<3>, from: usize, rows: usize| {
        t.clone()
            .slice(from..from + segments * rows)
            .reshape([segments, rows, heads, head_dim])
    };
    let q = split(q, at + first_query, queries);
    attention::attend(q, split(k, at, len), split(v, at, len), 1.0, kernel)
        .reshape([segments * queries, heads * head_dim])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of one segment's scores: `4 · heads · len · len`.
    fn scores(heads: usize, len: usize) -> u64 {
        (4 * heads * len * len) as u64
    }

    fn whole(at: usize, segments: usize, len: usize) -> Piece {
        Piece {
            at,
            segments,
            len,
            first_query: 0,
            queries: len,
        }
    }

    #[test]
    fn one_size_goes_together_as_far_as_the_limit_allows() {
        let images = [64; 8];
        assert_eq!(pieces(&images, 2, u64::MAX), vec![whole(0, 8, 64)]);
        // Three segments' scores fit, four do not.
        let limit = 4 * scores(2, 64) - 1;
        assert_eq!(
            pieces(&images, 2, limit),
            vec![whole(0, 3, 64), whole(192, 3, 64), whole(384, 2, 64)]
        );
    }

    #[test]
    fn runs_of_one_length_go_apart() {
        let segments = [16, 16, 4, 16];
        assert_eq!(
            pieces(&segments, 1, u64::MAX),
            vec![whole(0, 2, 16), whole(32, 1, 4), whole(36, 1, 16)]
        );
    }

    #[test]
    fn a_segment_too_large_for_the_limit_goes_in_query_blocks() {
        // Scores of 5 queries over 64 keys, 2 heads, fit; 6 do not.
        let limit = (4 * 2 * 64 * 5) as u64;
        let got = pieces(&[4, 64], 2, limit);
        assert_eq!(got[0], whole(0, 1, 4));
        let blocks = &got[1..];
        assert_eq!(blocks.len(), 13);
        for (i, piece) in blocks.iter().enumerate() {
            assert_eq!((piece.at, piece.segments, piece.len), (4, 1, 64));
            assert_eq!(piece.first_query, 5 * i);
            assert_eq!(piece.queries, if i == 12 { 4 } else { 5 });
        }
        // Not even one query's scores fit: one query at a time.
        assert_eq!(pieces(&[3], 2, 1).len(), 3);
    }

    #[test]
    fn nothing_to_attend() {
        assert!(pieces(&[], 16, u64::MAX).is_empty());
    }
}
