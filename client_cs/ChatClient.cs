using System;
using System.Collections.Generic;
using System.Globalization;
using System.IO;
using System.Linq;
using System.Net.Http;
using System.Net.Http.Headers;
using System.Text;
using System.Text.RegularExpressions;
using System.Threading;
using System.Threading.Tasks;

namespace ChatCli
{
    public enum Outcome
    {
        Done,          // event: done
        StreamError,   // event: error
        Truncated,     // the stream ended (or broke) without done/error
        HttpError,     // an HTTP error status before the stream
        ConnectFailed, // no response at all
        Cancelled,     // the CancellationToken fired
    }

    public sealed class ChatResult
    {
        public Outcome Outcome;
        public DoneData Done;        // Outcome.Done
        public ErrorDetail Error;    // StreamError, and HttpError when the body was the JSON envelope
        public int HttpStatus;       // HttpError
        public string HttpReason;    // HttpError
        public string Message;       // human-readable detail for everything but Done
        public int Deltas;
        public string StreamId;      // the x-stream-id of a resumable stream, else null
        public long LastEventId;     // the id of the last event handled (resumable streams)
        public int Reconnects;       // connections opened after the first one
    }

    /// <summary>
    /// POSTs to /api/chat and hands each text delta to a callback as it arrives. When the app makes
    /// the stream resumable (it answers with x-stream-id and numbers its events), a connection that
    /// drops before the last event is opened again on streams/ID with Last-Event-ID, up to
    /// <see cref="MaxReconnects"/> failed attempts in a row, waiting <see cref="Backoff"/> before each.
    /// </summary>
    public sealed class ChatClient : IDisposable
    {
        /// <summary>The wait before reconnection attempt 1, 2, ...; the last one for any later attempt.</summary>
        public static readonly TimeSpan[] Backoff =
        {
            TimeSpan.FromSeconds(0.5), TimeSpan.FromSeconds(1), TimeSpan.FromSeconds(2),
            TimeSpan.FromSeconds(4), TimeSpan.FromSeconds(8),
        };

        static readonly Regex StreamIdPattern = new Regex("^[A-Za-z0-9_-]{16,128}$", RegexOptions.CultureInvariant);
        static readonly Regex EventIdPattern = new Regex("^[0-9]{1,15}$", RegexOptions.CultureInvariant);

        readonly HttpClient http;
        readonly Uri url;
        readonly string key;
        readonly string callerKey;

        /// <summary>Failed reconnection attempts in a row before giving up (0: never reconnect).
        /// An attempt that brings new events starts the count again.</summary>
        public int MaxReconnects = 5;

        /// <summary>Told about each lost connection and reconnection (Program prints it with --stats).</summary>
        public Action<string> Log = delegate { };

        /// <summary>Called with the stream id as soon as a resumable stream's headers are in.</summary>
        public Action<string> StreamStarted = delegate { };

        /// <param name="key">the function key (x-functions-key), or null</param>
        /// <param name="callerKey">the caller key (Authorization: Bearer), or null</param>
        public ChatClient(string url, string key, string callerKey)
        {
            this.url = new Uri(url);
            this.key = key;
            this.callerKey = callerKey;
            var handler = new HttpClientHandler();
            handler.AllowAutoRedirect = false;
            http = new HttpClient(handler);
            // A reply may stream for minutes; Ctrl+C (the CancellationToken) is the way out.
            http.Timeout = Timeout.InfiniteTimeSpan;
        }

        public void Dispose()
        {
            http.Dispose();
        }

        public static bool IsStreamId(string id)
        {
            return id != null && StreamIdPattern.IsMatch(id);
        }

        /// <summary>streams/ID (plus <paramref name="suffix"/>) next to the chat URL: /api/chat becomes
        /// /api/streams/ID. The chat URL's query (e.g. ?code=KEY) is kept.</summary>
        public Uri StreamUri(string streamId, string suffix)
        {
            var builder = new UriBuilder(url);
            string path = builder.Path.TrimEnd('/');
            builder.Path = path.Substring(0, path.LastIndexOf('/') + 1) + "streams/" + Uri.EscapeDataString(streamId) + suffix;
            return builder.Uri;
        }

        /// <summary>Sends the prompt and follows the reply to its last event.</summary>
        public Task<ChatResult> StreamAsync(ChatRequest body, Action<string> onDelta, CancellationToken ct)
        {
            var request = NewRequest(HttpMethod.Post, url);
            var content = new ByteArrayContent(new UTF8Encoding(false).GetBytes(Json.Write(body)));
            content.Headers.ContentType = new MediaTypeHeaderValue("application/json");
            request.Content = content;
            return FollowAsync(request, new ChatResult(), onDelta, ct);
        }

        /// <summary>Continues a resumable stream by its id: the events after <paramref name="lastEventId"/>
        /// (0: from the start), then the rest as it comes.</summary>
        public Task<ChatResult> ResumeAsync(string streamId, long lastEventId, Action<string> onDelta, CancellationToken ct)
        {
            var result = new ChatResult { StreamId = streamId, LastEventId = lastEventId };
            return FollowAsync(ResumeRequest(result), result, onDelta, ct);
        }

        /// <summary>POST streams/ID/cancel: the app stops the generation (a hang-up does not stop a
        /// resumable stream). Returns null when the app said yes, else why not.</summary>
        public async Task<string> CancelAsync(string streamId, TimeSpan timeout)
        {
            var request = NewRequest(HttpMethod.Post, StreamUri(streamId, "/cancel"));
            request.Content = new ByteArrayContent(new byte[0]);
            using (var cts = new CancellationTokenSource(timeout))
            {
                try
                {
                    using (var response = await http.SendAsync(request, HttpCompletionOption.ResponseHeadersRead, cts.Token).ConfigureAwait(false))
                    {
                        if (response.IsSuccessStatusCode) return null;
                        return "HTTP " + (int)response.StatusCode + " " + response.ReasonPhrase;
                    }
                }
                catch (Exception e) when (e is HttpRequestException || e is IOException || e is System.Net.WebException ||
                                          e is System.Net.Sockets.SocketException || e is OperationCanceledException)
                {
                    return cts.IsCancellationRequested ? "no answer within " + timeout.TotalSeconds + " s" : InnermostMessage(e);
                }
            }
        }

        HttpRequestMessage NewRequest(HttpMethod method, Uri uri)
        {
            var request = new HttpRequestMessage(method, uri);
            request.Headers.Accept.Add(new MediaTypeWithQualityHeaderValue("text/event-stream"));
            // One request per connection: ask for it to be closed afterwards, so that disposing an
            // unfinished response drops the socket instead of draining it.
            request.Headers.ConnectionClose = true;
            if (!string.IsNullOrEmpty(key)) request.Headers.TryAddWithoutValidation("x-functions-key", key);
            if (!string.IsNullOrEmpty(callerKey)) request.Headers.TryAddWithoutValidation("Authorization", "Bearer " + callerKey);
            return request;
        }

        HttpRequestMessage ResumeRequest(ChatResult result)
        {
            var request = NewRequest(HttpMethod.Get, StreamUri(result.StreamId, ""));
            if (result.LastEventId > 0)
                request.Headers.TryAddWithoutValidation("Last-Event-ID", result.LastEventId.ToString(CultureInfo.InvariantCulture));
            return request;
        }

        async Task<ChatResult> FollowAsync(HttpRequestMessage request, ChatResult result, Action<string> onDelta, CancellationToken ct)
        {
            int failures = 0; // failed reconnection attempts in a row
            while (true)
            {
                long before = result.LastEventId;
                bool lost = await ReadOnceAsync(request, result, onDelta, ct).ConfigureAwait(false);
                if (!lost || result.StreamId == null || ct.IsCancellationRequested) return result;
                if (result.LastEventId > before) failures = 0;
                if (failures >= MaxReconnects)
                {
                    // Given up: whatever the last attempt met (no connection, a 503, another drop),
                    // the answer is cut off, and the app may still have the rest.
                    if (result.Outcome == Outcome.HttpError && result.Error != null && !string.IsNullOrEmpty(result.Error.Message))
                        result.Message += ": " + result.Error.Message;
                    result.Outcome = Outcome.Truncated;
                    result.Error = null;
                    if (MaxReconnects > 0)
                        result.Message += " (" + MaxReconnects + " reconnection " + (MaxReconnects == 1 ? "attempt" : "attempts") + " failed)";
                    return result;
                }
                TimeSpan delay = Backoff[Math.Min(failures, Backoff.Length - 1)];
                failures++;
                string what = result.Reconnects == 0 || result.LastEventId > before ? "connection lost" : "reconnection failed";
                Log(what + " after event " + result.LastEventId.ToString(CultureInfo.InvariantCulture) + ": " +
                    result.Message + "; reconnecting in " + delay.TotalSeconds.ToString("0.0", CultureInfo.InvariantCulture) +
                    " s (attempt " + failures + " of " + MaxReconnects + ")");
                try
                {
                    await Task.Delay(delay, ct).ConfigureAwait(false);
                }
                catch (OperationCanceledException)
                {
                    result.Outcome = Outcome.Cancelled;
                    return result;
                }
                result.Reconnects++;
                request = ResumeRequest(result);
            }
        }

        /// <summary>
        /// One connection: sends the request and reads its events into <paramref name="result"/>.
        /// Returns true when the connection was lost before the last event (no connection, a broken or
        /// ended body, or a status worth another try), which a resumable stream can reconnect after.
        /// </summary>
        async Task<bool> ReadOnceAsync(HttpRequestMessage request, ChatResult result, Action<string> onDelta, CancellationToken ct)
        {
            bool resuming = result.StreamId != null;
            result.Error = null;
            result.Message = null;
            HttpResponseMessage response;
            try
            {
                // ResponseHeadersRead: return as soon as the headers are in, and stream the body.
                response = await http.SendAsync(request, HttpCompletionOption.ResponseHeadersRead, ct).ConfigureAwait(false);
            }
            catch (Exception e) when (ct.IsCancellationRequested)
            {
                GC.KeepAlive(e);
                result.Outcome = Outcome.Cancelled;
                return false;
            }
            catch (Exception e) when (e is HttpRequestException || e is IOException || e is System.Net.WebException ||
                                      e is System.Net.Sockets.SocketException || e is OperationCanceledException)
            {
                result.Outcome = resuming ? Outcome.Truncated : Outcome.ConnectFailed;
                result.Message = resuming ? "could not reconnect: " + InnermostMessage(e) : InnermostMessage(e);
                return true;
            }

            using (response)
            // Disposing the response is what aborts a read that is waiting for the network:
            // the connection closes and the server notices that the client has gone.
            using (ct.Register(() => response.Dispose()))
            {
                if (!response.IsSuccessStatusCode)
                {
                    result.Outcome = Outcome.HttpError;
                    result.HttpStatus = (int)response.StatusCode;
                    result.HttpReason = response.ReasonPhrase;
                    string text = "";
                    try
                    {
                        text = await response.Content.ReadAsStringAsync().ConfigureAwait(false);
                    }
                    catch (Exception e) when (e is HttpRequestException || e is IOException || e is ObjectDisposedException)
                    {
                        GC.KeepAlive(e);
                    }
                    var envelope = Json.TryRead<ErrorEnvelope>(text);
                    if (envelope != null && envelope.Error != null) result.Error = envelope.Error;
                    else result.Message = Shorten(text);
                    if (ct.IsCancellationRequested)
                    {
                        result.Outcome = Outcome.Cancelled;
                        return false;
                    }
                    if (resuming && IsWorthAnotherTry(result.HttpStatus))
                    {
                        result.Message = "HTTP " + result.HttpStatus + " " + result.HttpReason;
                        return true;
                    }
                    return false;
                }

                var mediaType = response.Content.Headers.ContentType == null ? null : response.Content.Headers.ContentType.MediaType;
                if (!string.Equals(mediaType, "text/event-stream", StringComparison.OrdinalIgnoreCase))
                {
                    result.Outcome = Outcome.Truncated;
                    result.Message = "expected a text/event-stream response, got " + (mediaType ?? "no content type");
                    return false;
                }

                if (!resuming)
                {
                    IEnumerable<string> values;
                    if (response.Headers.TryGetValues("x-stream-id", out values))
                    {
                        string id = values.FirstOrDefault();
                        if (IsStreamId(id))
                        {
                            result.StreamId = id;
                            StreamStarted(id);
                        }
                    }
                }

                bool lost = false;
                try
                {
                    var stream = new CancellableStream(await response.Content.ReadAsStreamAsync().ConfigureAwait(false), ct);
                    // UTF-8 decoding in StreamReader keeps the partial bytes of a character that
                    // is split across two network reads until the rest arrives.
                    using (var reader = new StreamReader(stream, new UTF8Encoding(false), true, 4096))
                    {
                        var sse = new SseReader(reader);
                        while (true)
                        {
                            SseEvent ev = await sse.ReadEventAsync().ConfigureAwait(false);
                            if (ev == null)
                            {
                                result.Outcome = Outcome.Truncated;
                                result.Message = "the stream ended without a done or error event";
                                lost = true;
                                break;
                            }
                            long id = -1;
                            if (result.StreamId != null && ev.Id != null && EventIdPattern.IsMatch(ev.Id))
                            {
                                id = long.Parse(ev.Id, CultureInfo.InvariantCulture);
                                if (id <= result.LastEventId) continue; // handled already: a replay from too early
                            }
                            if (result.StreamId != null && ev.Type == "error" && IsReaderFailure(ev.Data))
                            {
                                // Not the stream's end: the app could not read it from its store just
                                // now (stream_store_unavailable), or the instance producing it stops and
                                // the stream goes on on another (stream_moved). It has no id; the next
                                // attempt asks again from the last event handled.
                                result.Outcome = Outcome.Truncated;
                                result.Message = "this reading of the stream ended (" + ReaderFailureType(ev.Data) + ")";
                                lost = true;
                                break;
                            }
                            bool last = Handle(ev, result, onDelta);
                            if (id >= 0) result.LastEventId = id;
                            if (last) break;
                        }
                    }
                }
                catch (Exception e) when (ct.IsCancellationRequested)
                {
                    GC.KeepAlive(e);
                    result.Outcome = Outcome.Cancelled;
                }
                catch (Exception e) when (e is IOException || e is HttpRequestException || e is System.Net.WebException ||
                                          e is ObjectDisposedException)
                {
                    result.Outcome = Outcome.Truncated;
                    result.Message = "the connection broke before a done or error event: " + InnermostMessage(e);
                    lost = true;
                }
                if (ct.IsCancellationRequested && result.Outcome == Outcome.Truncated)
                {
                    result.Outcome = Outcome.Cancelled;
                    lost = false;
                }
                return lost;
            }
        }

        /// <summary>One event; returns true when it was the last one (done, error, or unreadable).</summary>
        static bool Handle(SseEvent ev, ChatResult result, Action<string> onDelta)
        {
            if (ev.Type == "message")
            {
                var d = Json.TryRead<DeltaData>(ev.Data);
                if (d == null)
                {
                    result.Outcome = Outcome.Truncated;
                    result.Message = "unreadable delta event: " + Shorten(ev.Data);
                    return true;
                }
                if (!string.IsNullOrEmpty(d.Delta))
                {
                    result.Deltas++;
                    onDelta(d.Delta);
                }
                return false;
            }
            if (ev.Type == "done")
            {
                result.Outcome = Outcome.Done;
                result.Done = Json.TryRead<DoneData>(ev.Data) ?? new DoneData();
                return true;
            }
            if (ev.Type == "error")
            {
                result.Outcome = Outcome.StreamError;
                var envelope = Json.TryRead<ErrorEnvelope>(ev.Data);
                if (envelope != null && envelope.Error != null) result.Error = envelope.Error;
                else result.Message = Shorten(ev.Data);
                return true;
            }
            return false; // other event types are ignored, so the server can add some later
        }

        static readonly string[] ReaderEnds = { "stream_store_unavailable", "stream_moved" };

        /// <summary>An error event that ends one reading of a resumable stream, not the stream.</summary>
        static bool IsReaderFailure(string data)
        {
            return ReaderFailureType(data) != null;
        }

        static string ReaderFailureType(string data)
        {
            var envelope = Json.TryRead<ErrorEnvelope>(data);
            if (envelope == null || envelope.Error == null) return null;
            foreach (string kind in ReaderEnds)
                if (envelope.Error.Type == kind || envelope.Error.Code == kind) return kind;
            return null;
        }

        static bool IsWorthAnotherTry(int status)
        {
            return status == 408 || status == 429 || status == 500 || status == 502 || status == 503 || status == 504;
        }

        /// <summary>
        /// Passes a CancellationToken to every asynchronous read of the wrapped stream.
        /// StreamReader.ReadLineAsync takes no token (before .NET 7, and never on Mono), and on
        /// Mono disposing the response only ends a pending read about 2 s later; a read that is
        /// given the token ends at once.
        /// </summary>
        sealed class CancellableStream : Stream
        {
            readonly Stream inner;
            readonly CancellationToken ct;

            public CancellableStream(Stream inner, CancellationToken ct)
            {
                this.inner = inner;
                this.ct = ct;
            }

            public override Task<int> ReadAsync(byte[] buffer, int offset, int count, CancellationToken cancellationToken)
            {
                if (!cancellationToken.CanBeCanceled) cancellationToken = ct;
                return inner.ReadAsync(buffer, offset, count, cancellationToken);
            }

            public override int Read(byte[] buffer, int offset, int count)
            {
                return inner.Read(buffer, offset, count);
            }

            protected override void Dispose(bool disposing)
            {
                if (disposing) inner.Dispose();
                base.Dispose(disposing);
            }

            public override bool CanRead { get { return true; } }
            public override bool CanSeek { get { return false; } }
            public override bool CanWrite { get { return false; } }
            public override long Length { get { throw new NotSupportedException(); } }
            public override long Position
            {
                get { throw new NotSupportedException(); }
                set { throw new NotSupportedException(); }
            }
            public override void Flush() { }
            public override long Seek(long offset, SeekOrigin origin) { throw new NotSupportedException(); }
            public override void SetLength(long value) { throw new NotSupportedException(); }
            public override void Write(byte[] buffer, int offset, int count) { throw new NotSupportedException(); }
        }

        static string InnermostMessage(Exception e)
        {
            string message = e.Message;
            for (Exception inner = e.InnerException; inner != null; inner = inner.InnerException)
                message = inner.Message;
            return message;
        }

        static string Shorten(string text)
        {
            text = (text ?? "").Trim();
            return text.Length <= 500 ? text : text.Substring(0, 500) + "...";
        }
    }
}
