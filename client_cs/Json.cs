using System.Collections.Generic;
using System.IO;
using System.Runtime.Serialization;
using System.Runtime.Serialization.Json;
using System.Text;

namespace ChatCli
{
    // The wire types of POST /api/chat, read and written with DataContractJsonSerializer:
    // it ships with both .NET 8 and Mono, so the client needs no NuGet package and builds
    // with `mcs` too. Members missing from the JSON stay null; unknown members are ignored.

    [DataContract]
    public sealed class ChatMessage
    {
        [DataMember(Name = "role", Order = 1)] public string Role;
        [DataMember(Name = "content", Order = 2)] public string Content;
    }

    [DataContract]
    public sealed class ChatRequest
    {
        // EmitDefaultValue = false leaves null members out: the body carries either
        // "prompt" or "messages", never both, and "model" only when one was chosen.
        [DataMember(Name = "prompt", EmitDefaultValue = false, Order = 1)] public string Prompt;
        [DataMember(Name = "messages", EmitDefaultValue = false, Order = 2)] public List<ChatMessage> Messages;
        [DataMember(Name = "model", EmitDefaultValue = false, Order = 3)] public string Model;
    }

    /// <summary>Data of an unnamed event: <c>{"delta": "..."}</c>.</summary>
    [DataContract]
    public sealed class DeltaData
    {
        [DataMember(Name = "delta")] public string Delta;
    }

    [DataContract]
    public sealed class Usage
    {
        [DataMember(Name = "prompt_tokens")] public long? PromptTokens;
        [DataMember(Name = "completion_tokens")] public long? CompletionTokens;
        [DataMember(Name = "total_tokens")] public long? TotalTokens;
    }

    /// <summary>Data of <c>event: done</c>.</summary>
    [DataContract]
    public sealed class DoneData
    {
        [DataMember(Name = "finish_reason")] public string FinishReason;
        [DataMember(Name = "usage")] public Usage Usage;
        [DataMember(Name = "model")] public string Model;
        [DataMember(Name = "id")] public string Id;
        [DataMember(Name = "stream_id")] public string StreamId; // resumable streams only
    }

    [DataContract]
    public sealed class ErrorDetail
    {
        [DataMember(Name = "type")] public string Type;
        [DataMember(Name = "code")] public string Code;
        [DataMember(Name = "message")] public string Message;
        [DataMember(Name = "param")] public string Param;
        [DataMember(Name = "retryable")] public bool? Retryable;
    }

    /// <summary>
    /// <c>{"error": {...}}</c>: the body of an HTTP error status, and the data of <c>event: error</c>.
    /// </summary>
    [DataContract]
    public sealed class ErrorEnvelope
    {
        [DataMember(Name = "error")] public ErrorDetail Error;
    }

    public static class Json
    {
        // One serializer per type, built on first use (building one is the slow part).
        static class Serializer<T>
        {
            public static readonly DataContractJsonSerializer Instance = new DataContractJsonSerializer(typeof(T));
        }

        static readonly UTF8Encoding Utf8 = new UTF8Encoding(false);

        /// <summary>Serializes to a UTF-8 JSON string. (The serializer writes "/" as "\/", which is valid JSON.)</summary>
        public static string Write<T>(T value)
        {
            var serializer = Serializer<T>.Instance;
            using (var ms = new MemoryStream())
            {
                serializer.WriteObject(ms, value);
                return Utf8.GetString(ms.ToArray());
            }
        }

        /// <summary>Parses JSON text; throws SerializationException when it is not valid for T.</summary>
        public static T Read<T>(string json) where T : class
        {
            var serializer = Serializer<T>.Instance;
            using (var ms = new MemoryStream(Utf8.GetBytes(json)))
            {
                return (T)serializer.ReadObject(ms);
            }
        }

        /// <summary>Like <see cref="Read{T}"/> but returns null instead of throwing.</summary>
        public static T TryRead<T>(string json) where T : class
        {
            if (string.IsNullOrEmpty(json)) return null;
            try
            {
                return Read<T>(json);
            }
            catch (SerializationException) { return null; }
            catch (System.Xml.XmlException) { return null; }
            catch (System.ArgumentException) { return null; }
            catch (System.FormatException) { return null; }
            catch (System.InvalidCastException) { return null; }
        }
    }
}
