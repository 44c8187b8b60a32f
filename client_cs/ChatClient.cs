using System;
using System.IO;
using System.Net.Http;
using System.Net.Http.Headers;
using System.Text;
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
    }

    /// <summary>POSTs to /api/chat and hands each text delta to a callback as it arrives.</summary>
    public sealed class ChatClient : IDisposable
    {
        readonly HttpClient http;
        readonly Uri url;
        readonly string key;

        public ChatClient(string url, string key)
        {
            this.url = new Uri(url);
            this.key = key;
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

        public async Task<ChatResult> StreamAsync(ChatRequest body, Action<string> onDelta, CancellationToken ct)
        {
            var result = new ChatResult();
            var request = new HttpRequestMessage(HttpMethod.Post, url);
            var content = new ByteArrayContent(new UTF8Encoding(false).GetBytes(Json.Write(body)));
            content.Headers.ContentType = new MediaTypeHeaderValue("application/json");
            request.Content = content;
            request.Headers.Accept.Add(new MediaTypeWithQualityHeaderValue("text/event-stream"));
            // One request per run: ask for the connection to be closed afterwards, so that
            // disposing an unfinished response drops the socket instead of draining it.
            request.Headers.ConnectionClose = true;
            if (!string.IsNullOrEmpty(key)) request.Headers.TryAddWithoutValidation("x-functions-key", key);

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
                return result;
            }
            catch (Exception e) when (e is HttpRequestException || e is IOException || e is System.Net.WebException ||
                                      e is System.Net.Sockets.SocketException || e is OperationCanceledException)
            {
                result.Outcome = Outcome.ConnectFailed;
                result.Message = InnermostMessage(e);
                return result;
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
                    if (ct.IsCancellationRequested) result.Outcome = Outcome.Cancelled;
                    return result;
                }

                var mediaType = response.Content.Headers.ContentType == null ? null : response.Content.Headers.ContentType.MediaType;
                if (!string.Equals(mediaType, "text/event-stream", StringComparison.OrdinalIgnoreCase))
                {
                    result.Outcome = Outcome.Truncated;
                    result.Message = "expected a text/event-stream response, got " + (mediaType ?? "no content type");
                    return result;
                }

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
                                break;
                            }
                            if (ev.Type == "message")
                            {
                                var d = Json.TryRead<DeltaData>(ev.Data);
                                if (d == null)
                                {
                                    result.Outcome = Outcome.Truncated;
                                    result.Message = "unreadable delta event: " + Shorten(ev.Data);
                                    break;
                                }
                                if (!string.IsNullOrEmpty(d.Delta))
                                {
                                    result.Deltas++;
                                    onDelta(d.Delta);
                                }
                            }
                            else if (ev.Type == "done")
                            {
                                result.Outcome = Outcome.Done;
                                result.Done = Json.TryRead<DoneData>(ev.Data) ?? new DoneData();
                                break;
                            }
                            else if (ev.Type == "error")
                            {
                                result.Outcome = Outcome.StreamError;
                                var envelope = Json.TryRead<ErrorEnvelope>(ev.Data);
                                if (envelope != null && envelope.Error != null) result.Error = envelope.Error;
                                else result.Message = Shorten(ev.Data);
                                break;
                            }
                            // Other event types are ignored, so the server can add some later.
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
                }
                if (ct.IsCancellationRequested && result.Outcome == Outcome.Truncated)
                    result.Outcome = Outcome.Cancelled;
                return result;
            }
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
