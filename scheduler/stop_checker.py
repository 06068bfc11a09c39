"""Whether a request's latest sampled token ends it (token ids and lengths only).

Stop strings need detokenized text, so the front end checks them and ends the
request through `Scheduler.finish_request`.
"""

from __future__ import annotations

from pdserve.common.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the last output token puts `request` in, or None.

    A stop token wins over a length cap reached by the same token, so the client
    learns that the model chose to stop. Sets `request.stop_reason` for stop token ids.
    """
    params = request.sampling_params
    num_output = request.num_output_tokens
    last = request.output_token_ids[-1]
    if num_output >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
