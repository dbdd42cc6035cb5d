"""Following a job in the background: client.follow(job_id, on_event=...) returns a Follower, whose thread receives
the job's events while the caller (a notebook cell, a plotting loop) goes on."""
import sys
import threading
import traceback

from geotrain.errors import GeotrainError


class Follower:
    """A job's events received by a background thread until the job ends or stop() is called.

    on_event(event) is called in that thread with each JobEvent, in order, after it was appended to `events`;
    on_end(follower), once, when the thread ends (the job ended, stop(), or an error). An exception raised by a
    callback, or a failure of the stream that reconnecting did not cure, ends the follow: it is kept in `error`,
    printed on stderr, and raised again by wait(). The callbacks run in the follower's thread: what they change
    (a figure, a list) should not be changed by another thread meanwhile; a figure that only the callbacks draw,
    shown through an IPython display handle (display(fig, display_id=True), then handle.update(fig)), is fine.
    """

    def __init__(self, client, job_id, after_seq=0, reconnect_seconds=60.0, on_event=None, on_end=None):
        self.client = client
        self.job_id = job_id
        self.events = []  # every JobEvent received so far, in order
        self.error = None  # what ended the follow early, if anything did
        self._on_event = on_event
        self._on_end = on_end
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._call = None  # the WatchJob call in progress, which stop() cancels
        self._thread = threading.Thread(target=self._run, args=(after_seq, reconnect_seconds), daemon=True,
                                        name=f"geotrain-follow-{job_id}")
        self._thread.start()

    def __repr__(self):
        what = "stopped" if self.stopped else "done" if self.done else "following"
        return f"<geotrain.Follower {self.job_id}: {what}, {len(self.events)} events, state {self.state}>"

    @property
    def done(self):
        """True once the thread has ended: the job ended (every event received), stop() was called, or an error."""
        return not self._thread.is_alive()

    @property
    def stopped(self):
        """True once stop() was called."""
        return self._stopping.is_set()

    @property
    def state(self):
        """The job's state after the latest event received ("RUNNING", ...), None before the first."""
        events = self.events
        return events[-1].state if events else None

    @property
    def steps(self):
        """The step figures received so far (StepFigures records, in order): geotrain.steps_frame() takes them."""
        return [e.step for e in list(self.events) if e.step is not None]

    def stop(self, timeout=10.0):
        """Stops following (the job goes on) and waits up to `timeout` seconds (0: not at all) for the thread to
        end. Returns whether it has."""
        with self._lock:
            self._stopping.set()
            if self._call is not None:
                self._call.cancel()
        if timeout != 0 and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return self.done

    def join(self, timeout=None):
        """Waits until the thread has ended (or `timeout` seconds have passed); returns whether it has."""
        self._thread.join(timeout)
        return self.done

    def wait(self, timeout=None):
        """Waits until the job has ended (or `timeout` seconds: TimeoutError) and returns its JobStatus; raises the
        error that ended the follow early, if one did."""
        if not self.join(timeout):
            raise TimeoutError(f"{self.job_id} has not ended after {timeout} s (it goes on; wait again, or stop())")
        if self.error is not None:
            raise self.error
        return self.client.status(self.job_id)

    def _set_call(self, call):
        with self._lock:
            self._call = call
            if self._stopping.is_set():
                call.cancel()

    def _run(self, after_seq, reconnect_seconds):
        try:
            for event in self.client._watch(self.job_id, after_seq, reconnect_seconds, stop=self._stopping,
                                            on_call=self._set_call):
                self.events.append(event)
                if self._on_event is not None:
                    self._on_event(event)
        except GeotrainError as e:
            self.error = e
            print(f"geotrain: following {self.job_id} stopped: {e}", file=sys.stderr)
        except Exception as e:  # a callback's: the traceback says where
            self.error = e
            print(f"geotrain: following {self.job_id} stopped: on_event raised {type(e).__name__}", file=sys.stderr)
            traceback.print_exc()
        finally:
            if self._on_end is not None:
                try:
                    self._on_end(self)
                except Exception as e:
                    self.error = self.error or e
                    print(f"geotrain: following {self.job_id}: on_end raised {type(e).__name__}", file=sys.stderr)
                    traceback.print_exc()
